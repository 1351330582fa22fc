"""One-node ONNX graphs for the importer's op tests, and their check against ONNX Runtime (the reference). Import
after ``pytest.importorskip("onnx")`` and ``("onnxruntime")``."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from overdrive.engine.onnx import import_onnx

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
        np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL,
        np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.uint32): TensorProto.UINT32,
        np.dtype(np.uint64): TensorProto.UINT64}
TOL = 1e-5  # fp32 against ONNX Runtime's fp32, absolute and relative; index ops are exact


def one_node(op: str, inputs: list[tuple[str, np.ndarray | None]], attrs: dict, opset: int = 18) -> tuple[bytes, dict]:
    """``op`` over ``inputs`` (name, value): names starting with ``c`` are initializers, "" an absent optional
    input, the rest graph inputs; the output's type comes from ONNX shape inference."""
    feeds = {n: v for n, v in inputs if n and not n.startswith("c")}
    inits = [numpy_helper.from_array(v, n) for n, v in inputs if n.startswith("c")]
    node = helper.make_node(op, [n for n, _ in inputs], ["out"], name="the_node", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, ELEM[v.dtype], list(v.shape))
                                        for n, v in feeds.items()], [helper.make_empty_tensor_value_info("out")], inits)
    m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))
    return m.SerializeToString(), feeds


def check(model: bytes, feeds: dict[str, np.ndarray]) -> None:
    """The importer's output equals ONNX Runtime's in dtype and shape, and in value within :data:`TOL`."""
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    out = import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values())).numpy()
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)
