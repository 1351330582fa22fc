"""int8/fp8 engines from a float ONNX model: calibrate it into a Q/DQ model with ONNX Runtime's static
quantization (``onnxruntime.quantization.quantize_static``), the way ``trtexec --int8 --calib`` calibrates
an ONNX model; or, for int8 with dynamic activations, ONNX Runtime's ``quantize_dynamic``
(:func:`quantize_onnx_dynamic`: no calibration).

The Q/DQ layout is ``overdrive.quant``'s (and TensorRT's), whatever made the ONNX model: Q/DQ on the inputs of
Conv, ConvTranspose, Gemm and MatMul with a constant weight, never on their outputs; weights per output
channel and activations per tensor, both symmetric; max calibration for int8 (``INT8_DEFAULT``); ONNX Runtime's
distribution calibration for fp8 e4m3 (the only method it has for fp8). Activation x activation MatMuls
(attention's) stay float, as in ``INT8_DEFAULT``. Each quantized input gets its own Q/DQ pair, so the other
readers of that tensor (a residual add, a pooling, a graph output) keep the float values.

ONNX Runtime's defaults do otherwise: they also quantize every quantized op's output (a per-tensor scale set by
a feed-forward's outlier channels erases the other channels: issue 21's pretrained MiniLM), and a tensor that
one quantized op reads is replaced by its Q/DQ copy for every reader (the residual stream quantized).
``quantize_onnx`` turns the first off (``OpTypesToExcludeOutputQuantization``) and avoids the second by giving
each quantized input a private ``Identity`` copy to calibrate and quantize, removed again afterwards.
The residual-add quantizers of ``overdrive.quant`` (``residual_add``, for TensorRT's conv+add fusion) are not
made: neither backend here fuses them, and they cost accuracy.
"""

from __future__ import annotations

import contextlib
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
QUANTIZED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_COPY = "/overdrive_qin"  # suffix of the Identity nodes and tensors that carry one quantized input each


def quantizable_nodes(model: object) -> list[str]:
    """Names of the nodes to quantize in an ``onnx.ModelProto``: Conv, ConvTranspose and Gemm whose weight (input
    1) is an initializer, and MatMul ``x @ W`` with a 2-D initializer ``W`` (a Linear). Unnamed nodes are named in
    place (ONNX Runtime selects nodes by name).

    Example:
        >>> # quantizable_nodes(onnx.load("model.onnx"))  # ['/conv1/Conv', '/fc/Gemm']
    """
    graph = model.graph  # type: ignore[attr-defined]
    inits = {t.name: t for t in graph.initializer}
    names = []
    for i, node in enumerate(graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{i}"
        if node.op_type not in QUANTIZED_OPS or len(node.input) < 2 or node.input[1] not in inits:
            continue
        if node.op_type == "MatMul" and len(inits[node.input[1]].dims) != 2:
            continue  # a batched constant: no output-channel axis for per-channel scales
        if node.input[0] in inits:
            continue  # constant x constant: folded by ONNX Runtime, nothing to calibrate
        names.append(node.name)
    return names


def _private_inputs(model: object, nodes: list[str]) -> None:
    """Give input 0 of each node in ``nodes`` its own tensor, an Identity copy (in place): ONNX Runtime then
    calibrates and quantizes that copy, and the tensor's other readers keep the float values."""
    from onnx import helper

    graph = model.graph  # type: ignore[attr-defined]
    chosen, out = set(nodes), []
    for node in graph.node:
        if node.name in chosen:
            copy = node.name + _COPY
            out.append(helper.make_node("Identity", [node.input[0]], [copy], name=copy))
            node.input[0] = copy
        out.append(node)
    del graph.node[:]
    graph.node.extend(out)


def _drop_copies(model: object) -> None:
    """Remove the Identity copies of :func:`_private_inputs` again (in place): what read a copy (its Q node, or
    the node itself where ONNX Runtime left it float) reads the original tensor."""
    graph = model.graph  # type: ignore[attr-defined]
    source = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity" and n.name.endswith(_COPY)}
    keep = [n for n in graph.node if not (n.op_type == "Identity" and n.name.endswith(_COPY))]
    for node in keep:
        for k, name in enumerate(node.input):
            if name in source:
                node.input[k] = source[name]
    del graph.node[:]
    graph.node.extend(keep)
    for vi in [v for v in graph.value_info if v.name in source]:
        graph.value_info.remove(vi)


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """ONNX Runtime's quantizers log "consider pre-processing" on the root logger: silenced for their call."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def fit_batches(calib: Sequence[tuple[torch.Tensor, ...]], shapes: list[list[int | None]], names: list[str]
                ) -> list[tuple[torch.Tensor, ...]]:
    """Calibration batches in the batch size a model with a fixed batch dim takes: all rows in order, cut
    into batches of that size (a short tail dropped; fewer rows than one batch are repeated to fill it), so a
    file of 8 rows calibrates an engine built for batch 4. Other fixed dims must match: a clear error if not. An
    input whose first dim the model fixes at another size than the batch (a shared bias) is passed whole, as the
    first calibration batch has it.

    Example:
        >>> [b[0].shape[0] for b in fit_batches([(torch.zeros(8, 3),)], [[4, 3]], ["x"])]
        [4, 4]
    """
    calib = [tuple(b) for b in calib]
    for k, batch in enumerate(calib):
        for x, shape, n in zip(batch, shapes, names):
            for d, (got, want) in enumerate(zip(x.shape[1:], shape[1:]), start=1):
                if want is not None and got != want:
                    raise UsageError(f"calibration batch {k}: input {n!r} has shape {tuple(x.shape)} but the model "
                                     f"fixes dim {d} at {want}; give calibration data of shape (N, "
                                     f"{', '.join(str(v) for v in shape[1:])}) or build with a profile that lets "
                                     "that dim vary")
    b = shapes[0][0] if shapes and shapes[0] else None
    # an input whose first dim the model fixes at another size (a shared bias, a lookup table) has no batch dim:
    # it is passed as the first batch has it, never cut into rows
    batched = [not shape or shape[0] is None or shape[0] == b for shape in shapes]
    batched += [True] * (len(calib[0]) - len(batched) if calib else 0)
    if not calib or b is None or all(x.shape[0] == b for batch in calib for x, on in zip(batch, batched) if on):
        return calib
    cols = [torch.cat([batch[i] for batch in calib]) if batched[i] else calib[0][i] for i in range(len(calib[0]))]
    rows = next(c.shape[0] for c, on in zip(cols, batched) if on)
    if rows < b:
        reps = -(-b // rows)
        cols = [c.repeat(reps, *([1] * (c.dim() - 1)))[:b] if on else c for c, on in zip(cols, batched)]
        rows = b
    return [tuple(c[s:s + b] if on else c for c, on in zip(cols, batched)) for s in range(0, rows - b + 1, b)]


def calibration_feeds(onnx_model: bytes | object, calib: Sequence[tuple[torch.Tensor, ...]],
                      precision: str = "int8") -> list[dict[str, np.ndarray]]:
    """``calib`` (batches, one tensor per model input) as ONNX Runtime feeds for a float ONNX model (bytes or a
    ``ModelProto``): checked against its inputs, cut to its fixed batch size (:func:`fit_batches`) and cast to
    its input types.

    Example:
        >>> # feeds = calibration_feeds(open("model.onnx", "rb").read(), [(torch.randn(8, 3, 224, 224),)])
    """
    onnx = require("onnx", "onnx", "ONNX calibration")
    model = onnx.load_from_string(onnx_model) if isinstance(onnx_model, bytes) else onnx_model
    inits = {t.name for t in model.graph.initializer}
    inputs = [(i.name, _NP.get(i.type.tensor_type.elem_type, np.float32)) for i in model.graph.input if i.name not in inits]
    if not calib:
        raise UsageError(f"--precision {precision} from a float ONNX model needs calibration batches (--calib)")
    for k, batch in enumerate(calib):
        if len(batch) != len(inputs):
            raise UsageError(f"calibration batch {k} has {len(batch)} tensor(s) but the ONNX model takes "
                             f"{len(inputs)} input(s) {[n for n, _ in inputs]}; give one tensor per input")
    fixed = {i.name: [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
             for i in model.graph.input if i.name not in inits}
    batches = fit_batches(calib, [fixed[n] for n, _ in inputs], [n for n, _ in inputs])
    return [{n: x.detach().cpu().numpy().astype(dt) for (n, dt), x in zip(inputs, batch)} for batch in batches]


def _reader(feeds: list[dict[str, np.ndarray]]) -> object:
    """An ONNX Runtime ``CalibrationDataReader`` over ``feeds``."""
    from onnxruntime.quantization import CalibrationDataReader

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it: Iterator[dict[str, np.ndarray]] = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    return _Reader()


def quantize_onnx(onnx_bytes: bytes, calib: Sequence[tuple[torch.Tensor, ...]], precision: str = "int8") -> bytes:
    """A Q/DQ copy of a float ONNX model, calibrated on ``calib`` (batches, one tensor per model input).

    Example:
        >>> # qdq = quantize_onnx(open("model.onnx", "rb").read(), [(torch.randn(8, 3, 224, 224),)], "int8")
    """
    if precision not in ("int8", "fp8"):
        raise UsageError(f"quantize_onnx makes int8 or fp8 Q/DQ models, not {precision!r}")
    onnx = require("onnx", "onnx", "ONNX calibration")
    require("onnxruntime", "onnxruntime", "ONNX calibration")
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    model = onnx.load_from_string(onnx_bytes)
    feeds = calibration_feeds(model, calib, precision)
    nodes = quantizable_nodes(model)
    if not nodes:
        raise UsageError(f"--precision {precision}: the ONNX model has no Conv, ConvTranspose, Gemm or weight MatMul "
                         "(a constant weight, as a Linear exports) to quantize; build it in fp32/fp16 instead")
    _private_inputs(model, nodes)
    qtype = QuantType.QInt8 if precision == "int8" else QuantType.QFLOAT8E4M3FN
    method = CalibrationMethod.MinMax if precision == "int8" else CalibrationMethod.Distribution
    options = {"ActivationSymmetric": True, "WeightSymmetric": True,
               "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OPS)}  # inputs only, as overdrive.quant
    with _quiet_root_logger(), tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "qdq.onnx")
        try:
            quantize_static(model, out, _reader(feeds), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=qtype, weight_type=qtype, nodes_to_quantize=nodes,
                            op_types_to_quantize=list(QUANTIZED_OPS), calibrate_method=method, extra_options=options)
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"ONNX Runtime could not calibrate the model to {precision}: {type(exc).__name__}: "
                             f"{exc}; build from the PyTorch model with --calib, or from a Q/DQ ONNX model") from exc
        qdq = onnx.load(out)
    _drop_copies(qdq)
    return qdq.SerializeToString()


def quantize_onnx_integer(onnx_bytes: bytes, calib: Sequence[tuple[torch.Tensor, ...]]) -> bytes:
    """A Q/DQ copy of a float ONNX model in ONNX Runtime's own int8 layout, the one its CPU integer kernels fuse
    end to end: Q/DQ on the inputs *and outputs* of every op ONNX Runtime has an integer kernel for (Conv,
    MatMul, Add, pooling, Concat, ...; a ReLU after a quantized op is folded into its output range), activations
    uint8 with a zero point (so a ReLU's output uses all 256 levels), weights int8 per output channel, max
    calibration on ``calib``. ONNX Runtime's optimizer then turns a CNN into QLinearConv -> QLinearAdd -> ... in
    NHWC, with no float tensor in between; :func:`quantize_onnx`'s layout (inputs only) leaves each convolution
    in float behind a DequantizeLinear there. This layout quantizes the residual stream too, which costs accuracy
    on transformers: callers measure it (the onnxruntime backend times and checks both layouts).

    Example:
        >>> # q = quantize_onnx_integer(open("resnet.onnx", "rb").read(), [(torch.randn(8, 3, 224, 224),)])
    """
    onnx = require("onnx", "onnx", "ONNX calibration")
    require("onnxruntime", "onnxruntime", "ONNX calibration")
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    model = onnx.load_from_string(onnx_bytes)
    feeds = calibration_feeds(model, calib)
    if not quantizable_nodes(model):
        raise UsageError("--precision int8: the ONNX model has no Conv, ConvTranspose, Gemm or weight MatMul to "
                         "quantize; build it in fp32 instead")
    with _quiet_root_logger(), tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "fp32.onnx"), os.path.join(tmp, "int8.onnx")
        big = model.ByteSize() > 1_800_000_000  # protobuf's 2 GB limit: weights beside the file
        onnx.save(model, src, save_as_external_data=big)
        try:  # ONNX Runtime's pre-processing (shape inference, graph fusions) helps its quantizer find the patterns
            from onnxruntime.quantization.shape_inference import quant_pre_process

            pre = os.path.join(tmp, "pre.onnx")
            quant_pre_process(src, pre, skip_symbolic_shape=True, save_as_external_data=big)
            src = pre
        except Exception:  # noqa: BLE001 - optional: the quantizer runs on the exported model as it is
            pass
        try:
            quantize_static(src, out, _reader(feeds), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax, use_external_data_format=big,
                            extra_options={"ActivationSymmetric": False, "WeightSymmetric": True})
        except Exception as exc:
            raise UsageError(f"ONNX Runtime could not calibrate the model to int8: {type(exc).__name__}: {exc}; "
                             "build from the PyTorch model with --calib, or from a Q/DQ ONNX model") from exc
        return onnx.load(out).SerializeToString()


DYNAMIC_OPS = ("MatMul", "Attention")
"""What :func:`quantize_onnx_dynamic` quantizes: MatMul with a constant weight (ONNX Runtime's dynamic mode rewrites
each Gemm as MatMul + Add first) and the fused ``Attention`` contrib op. Convolutions stay float (ConvInteger is
no faster than ONNX Runtime's fp32 convolutions; CNNs want static int8), and so do embedding lookups (``Gather``,
which ONNX Runtime's default also quantizes: int8 tables save memory, not time, and cost accuracy)."""


def quantize_onnx_dynamic(onnx_bytes: bytes, reduce_range: bool = False) -> bytes:
    """An int8 copy of a float ONNX model with dynamic activations, ONNX Runtime's ``quantize_dynamic``: weights
    int8 per output channel (symmetric), activations uint8 with a scale and zero point computed from each input
    at run time (``DynamicQuantizeLinear``), so every weight MatMul becomes ``MatMulInteger`` (fused by ONNX
    Runtime's optimizer into ``DynamicQuantizeMatMul`` / ``MatMulIntegerToFloat``). Activation x activation
    MatMuls (attention's) stay float. ``reduce_range``: 7-bit weights, which keep the u8s8 kernels of x86 CPUs
    without VNNI from saturating (ONNX Runtime's advice for them).

    Example:
        >>> # q = quantize_onnx_dynamic(open("bert.onnx", "rb").read())  # no calibration batches
    """
    onnx = require("onnx", "onnx", "dynamic int8 quantization")
    require("onnxruntime", "onnxruntime", "dynamic int8 quantization")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load_from_string(onnx_bytes)
    names = quantizable_nodes(model)  # names unnamed nodes too
    ops = {n.name: n.op_type for n in model.graph.node}
    if not any(ops[n] in ("MatMul", "Gemm") for n in names) and "Attention" not in ops.values():
        raise UsageError("--int8-activations dynamic quantizes the weights of MatMul and Gemm layers (Linear), and "
                         "this ONNX model has none; for a CNN build static int8: --int8-activations static --calib "
                         "batches.pt")
    with _quiet_root_logger(), tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dynamic.onnx")
        try:
            quantize_dynamic(model, out, per_channel=True, weight_type=QuantType.QInt8, reduce_range=reduce_range,
                             op_types_to_quantize=list(DYNAMIC_OPS),
                             extra_options={"MatMulConstBOnly": True,  # weights only: attention's MatMuls stay float
                                            "DefaultTensorType": onnx.TensorProto.FLOAT})  # contrib ops' outputs
        except UsageError:
            raise
        except Exception as exc:
            raise UsageError(f"ONNX Runtime could not quantize the model dynamically: {type(exc).__name__}: {exc}; "
                             "build static int8 with --calib instead") from exc
        return onnx.load(out).SerializeToString()
