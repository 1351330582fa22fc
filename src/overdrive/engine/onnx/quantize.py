"""int8/fp8 engines from a float ONNX model: calibrate it into a Q/DQ model with ONNX Runtime's static
quantization (``onnxruntime.quantization.quantize_static``), the way ``trtexec --int8 --calib`` calibrates
an ONNX model.

The Q/DQ layout follows ``overdrive.quant``'s defaults, so an ONNX model and the PyTorch model it came
from get the same kind of engine: weights per output channel and activations per tensor, both symmetric;
max calibration for int8 (``INT8_DEFAULT``); ONNX Runtime's distribution calibration for fp8 e4m3 (the
only method it has for fp8). Quantized: Conv, ConvTranspose, Gemm, and MatMul with a constant weight
(activation x activation MatMuls, attention's, stay float as in ``INT8_DEFAULT``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.optional import require

_NP = {1: np.float32, 10: np.float16, 11: np.float64, 7: np.int64, 6: np.int32, 5: np.int16, 3: np.int8, 2: np.uint8,
       9: np.bool_}  # ONNX elem_type -> numpy


def quantizable_nodes(model: object) -> list[str]:
    """Names of the nodes to quantize in an ``onnx.ModelProto``: Conv, ConvTranspose, Gemm, and MatMul with an
    initializer (weight) input. Unnamed nodes are named in place (ONNX Runtime selects nodes by name).

    Example:
        >>> # quantizable_nodes(onnx.load("model.onnx"))  # ['/conv1/Conv', '/fc/Gemm']
    """
    graph = model.graph  # type: ignore[attr-defined]
    consts = {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    names = []
    for i, node in enumerate(graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
        weight_matmul = node.op_type == "MatMul" and any(x in consts for x in node.input)
        if node.op_type in ("Conv", "ConvTranspose", "Gemm") or weight_matmul:
            names.append(node.name)
    return names


def quantize_onnx(onnx_bytes: bytes, calib: Sequence[tuple[torch.Tensor, ...]], precision: str = "int8") -> bytes:
    """A Q/DQ copy of a float ONNX model, calibrated on ``calib`` (batches, one tensor per model input).

    Example:
        >>> # qdq = quantize_onnx(open("model.onnx", "rb").read(), [(torch.randn(8, 3, 224, 224),)], "int8")
    """
    if precision not in ("int8", "fp8"):
        raise UsageError(f"quantize_onnx makes int8 or fp8 Q/DQ models, not {precision!r}")
    onnx = require("onnx", "onnx", "ONNX calibration")
    require("onnxruntime", "onnxruntime", "ONNX calibration")
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    model = onnx.load_from_string(onnx_bytes)
    inits = {t.name for t in model.graph.initializer}
    inputs = [(i.name, _NP.get(i.type.tensor_type.elem_type, np.float32)) for i in model.graph.input if i.name not in inits]
    if not calib:
        raise UsageError(f"--precision {precision} from a float ONNX model needs calibration batches (--calib)")
    for k, batch in enumerate(calib):
        if len(batch) != len(inputs):
            raise UsageError(f"calibration batch {k} has {len(batch)} tensor(s) but the ONNX model takes "
                             f"{len(inputs)} input(s) {[n for n, _ in inputs]}; give one tensor per input")
    nodes = quantizable_nodes(model)
    if not nodes:
        raise UsageError(f"--precision {precision}: the ONNX model has no Conv, ConvTranspose, Gemm or weight MatMul "
                         "to quantize; build it in fp32/fp16 instead")

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it: Iterator[dict[str, np.ndarray]] = (
                {n: x.detach().cpu().numpy().astype(dt) for (n, dt), x in zip(inputs, batch)} for batch in calib)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    qtype = QuantType.QInt8 if precision == "int8" else QuantType.QFLOAT8E4M3FN
    method = CalibrationMethod.MinMax if precision == "int8" else CalibrationMethod.Distribution
    root = logging.getLogger()  # quantize_static logs "consider pre-processing" on the root logger
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "qdq.onnx")
            try:
                quantize_static(model, out, _Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                                activation_type=qtype, weight_type=qtype, nodes_to_quantize=nodes,
                                calibrate_method=method,
                                extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
            except UsageError:
                raise
            except Exception as exc:
                raise UsageError(f"ONNX Runtime could not calibrate the model to {precision}: {type(exc).__name__}: "
                                 f"{exc}; build from the PyTorch model with --calib, or from a Q/DQ ONNX model") from exc
            return open(out, "rb").read()
    finally:
        root.setLevel(level)
