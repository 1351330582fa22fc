"""Q/DQ forms beyond int8 per tensor / per axis in overdrive's ONNX importer (engine/onnx/qdq.py), each against ONNX
Runtime on the same model at ORT_DISABLE_ALL (Q/DQ computed as written): opset 21's blocked scales (``block_size``,
as ONNX Runtime's 4-bit weight quantizer writes them), int4 / uint4, fp8 ``saturate=0``, and the refusals of what
the importer cannot run faithfully (a per-axis scale of the wrong length, float8 ``fnuz``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper as h  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 16)).astype(np.float32)
W = RNG.standard_normal((16, 8)).astype(np.float32)  # (in, out), as MatMul reads it


def _model(nodes: list, inits: list, x_shape: list[int], y_shape: list[int], opset: int) -> bytes:
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, x_shape)],
                     [h.make_tensor_value_info("y", T.FLOAT, y_shape)], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 10 if opset >= 21 else 9
    return m.SerializeToString()


def _ort(b: bytes, x: np.ndarray) -> torch.Tensor:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return torch.from_numpy(ort.InferenceSession(b, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])


def _ours(b: bytes, x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return import_onnx(b).eval()(torch.from_numpy(x))


def _qdq(dtype: int, zp: float, scale: float, **attrs: int) -> tuple[list, list]:
    nodes = [h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs), h.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    return nodes, [nh.from_array(np.float32(scale), "s"), h.make_tensor("z", dtype, [], [zp])]


@pytest.mark.parametrize("axis,block", [(0, 4), (0, 5), (1, 3)])
@pytest.mark.parametrize("wtype", [T.INT8, T.INT4])
def test_blocked_weight_dequantize_matches_onnxruntime(axis: int, block: int, wtype: int) -> None:
    # a weight quantized per block of `block` rows (axis 0) or columns (axis 1), the last block ragged where it does
    # not divide; the importer used to reshape the 2-D scale as if per axis and fail on the broadcast
    qmax = 7 if wtype == T.INT4 else 127
    nblk = -(-W.shape[axis] // block)
    scale_shape = (nblk, 8) if axis == 0 else (16, nblk)
    scale = (RNG.uniform(0.5, 1.5, scale_shape) * np.abs(W).max() / qmax).astype(np.float32)
    full = np.repeat(scale, block, axis).take(range(W.shape[axis]), axis)
    q = np.clip(np.round(W / full), -qmax - 1, qmax).astype(np.int8)
    xs = np.float32(np.abs(X).max() / 127)
    nodes = [h.make_node("QuantizeLinear", ["x", "xs"], ["xq"], output_dtype=T.INT8),
             h.make_node("DequantizeLinear", ["xq", "xs"], ["xd"]),
             h.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=axis, block_size=block),
             h.make_node("MatMul", ["xd", "w"], ["y"])]
    inits = [nh.from_array(xs, "xs"), h.make_tensor("wq", wtype, list(q.shape), q.flatten().tolist()),
             nh.from_array(scale, "ws")]
    b = _model(nodes, inits, [4, 16], [4, 8], 21)
    torch.testing.assert_close(_ours(b, X), _ort(b, X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,zp", [(T.INT4, -3), (T.UINT4, 9)])
def test_four_bit_quantize_clamps_to_four_bits(dtype: int, zp: int) -> None:
    # the scale puts most values past the 4-bit range: a clamp to int8's range would keep them
    nodes, inits = _qdq(dtype, zp, float(np.abs(X).max() / 12))
    b = _model(nodes, inits, [4, 16], [4, 16], 21)
    ref = _ort(b, X)
    assert len(ref.unique()) <= 16
    torch.testing.assert_close(_ours(b, X), ref, rtol=0, atol=0)


def test_four_bit_output_dtype_without_zero_point() -> None:
    nodes = [h.make_node("QuantizeLinear", ["x", "s"], ["q"], output_dtype=T.INT4),
             h.make_node("DequantizeLinear", ["q", "s"], ["y"])]
    b = _model(nodes, [nh.from_array(np.float32(0.1), "s")], [4, 16], [4, 16], 21)
    torch.testing.assert_close(_ours(b, X), _ort(b, X), rtol=0, atol=0)


def test_fp8_e4m3fn_without_saturation_gives_nan_past_its_range() -> None:
    # saturate=0: past 464 (halfway from 448, the largest e4m3fn, to 480) a value becomes NaN; torch's cast saturates
    # to 448, which the importer returned before
    xv = np.concatenate([X.ravel(), [448.0, 463.9, 464.0, 464.1, -500.0, 1e4]]).astype(np.float32)
    nodes, inits = _qdq(T.FLOAT8E4M3FN, 0.0, 1.0, saturate=0)
    b = _model(nodes, inits, [xv.size], [xv.size], 19)
    ref, ours = _ort(b, xv), _ours(b, xv)
    assert ref.isnan().sum() == 3
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


def test_per_axis_scale_of_the_wrong_length_is_refused() -> None:
    # 8 scales on an axis of size 1 used to broadcast to 8 columns, where ONNX Runtime refuses the model
    nodes = [h.make_node("QuantizeLinear", ["x", "s"], ["q"], axis=1), h.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1)]
    b = _model(nodes, [nh.from_array(np.full(8, 0.1, np.float32), "s")], [4, 1], [4, 1], 17)
    with pytest.raises(UsageError, match=r"QuantizeLinear.*does not fit axis 1"):
        _ours(b, X[:, :1].copy())


def test_fnuz_float8_is_refused_naming_the_initializer() -> None:
    nodes, inits = _qdq(T.FLOAT8E4M3FNUZ, 0.0, 0.1)
    b = _model(nodes, inits, [4, 16], [4, 16], 21)
    with pytest.raises(UsageError, match=r"initializer 'z'.*float8_e4m3fnuz"):
        import_onnx(b)


def _qdq_model(zp_type: int) -> bytes:
    from onnx import TensorProto as T
    from onnx import helper as h

    zp = h.make_tensor("zp", zp_type, [], [0])
    s = h.make_tensor("s", T.FLOAT, [], [0.05])
    g = h.make_graph([h.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
                      h.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, [2, 4])], [h.make_tensor_value_info("y", T.FLOAT, [2, 4])],
                     [zp, s])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 19)]).SerializeToString()


def test_an_fp8_qdq_model_is_not_built_as_int8() -> None:
    """An fp8 Q/DQ model built with precision int8 ran its fp8 Q/DQ under the int8 name (header, --best table)."""
    from onnx import TensorProto as T

    from overdrive._utils.errors import UsageError
    from overdrive.engine import Builder, BuildConfig
    from overdrive.engine.backends.onnxruntime import qdq_formats

    fp8, int8 = _qdq_model(T.FLOAT8E4M3FN), _qdq_model(T.INT8)
    assert qdq_formats(fp8) == {"fp8"} and qdq_formats(int8) == {"int8"}
    with pytest.raises(UsageError, match="Q/DQ nodes quantize to fp8, not int8: build it with --fp8"):
        Builder(BuildConfig(precision="int8", backend="inductor")).build(fp8)
    eng = Builder(BuildConfig(precision="int8", backend="onnxruntime")).build(int8)  # its own format builds
    assert eng.header["precision"] == "int8"
