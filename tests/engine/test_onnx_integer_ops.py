"""The integer operators ONNX Runtime's quantization tool writes, imported and checked against ONNX Runtime's CPU
kernels: MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv, DynamicQuantizeLinear one node at a time (uint8
and int8, zero points per tensor and per axis), then whole models as ``quantize_static`` (QOperator and QDQ,
per channel and per tensor, uint8 and int8 activations) and ``quantize_dynamic`` write them. The QOperator models match
ONNX Runtime bit for bit, the dynamic ones in their integers (their float32 tail within an ulp or two); a QDQ
model within one step of its output scale of ONNX Runtime
run node by node (its graph optimizer fuses DQ -> op -> Q into integer kernels that round differently;
the importer runs each node as the spec defines it)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import SUPPORTED_CONTRIB_OPS, SUPPORTED_OPS, import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
quant = pytest.importorskip("onnxruntime.quantization")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def _ints(seed: int, dtype: type, *shape: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max + 1, shape).astype(dtype)


def _one_node(op: str, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray], outs: list[tuple[str, int]],
              **attrs) -> onnx.ModelProto:
    """One ``op`` node reading ``feeds`` (graph inputs) and ``consts`` (initializers), in the order given."""
    names = list(feeds) + list(consts)
    order = attrs.pop("order", names)
    node = helper.make_node(op, order, [o for o, _ in outs], name="n", **attrs)
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                      for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, t, None) for o, t in outs],
        [numpy_helper.from_array(v, k) for k, v in consts.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def _run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list, list]:
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))
    got = [got] if isinstance(got, torch.Tensor) else list(got)
    return [g.numpy() for g in got], want


def _assert_exact(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    got, want = _run_both(model, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("a_dt,b_dt", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8)])
@pytest.mark.parametrize("per_col", [False, True], ids=["b_zp_tensor", "b_zp_column"])
def test_matmul_integer_matches_onnxruntime(a_dt: type, b_dt: type, per_col: bool) -> None:
    a, b = _ints(0, a_dt, 2, 5, 64), _ints(1, b_dt, 64, 7)
    b_zp = _ints(3, b_dt, 7) if per_col else _ints(3, b_dt, 1).reshape(())
    model = _one_node("MatMulInteger", {"a": a}, {"b": b, "a_zp": _ints(2, a_dt, 1).reshape(()), "b_zp": b_zp},
                      [("y", TensorProto.INT32)])
    _assert_exact(model, {"a": a})


def test_conv_integer_matches_onnxruntime() -> None:
    """Padding holds x's zero point (zero once centered), strides and groups as Conv's."""
    x, w = _ints(0, np.uint8, 2, 4, 9, 9), _ints(1, np.uint8, 6, 2, 3, 3)
    model = _one_node("ConvInteger", {"x": x}, {"w": w, "x_zp": np.uint8(131), "w_zp": np.uint8(120)},
                      [("y", TensorProto.INT32)], pads=[1, 0, 2, 1], strides=[2, 1], group=2)
    _assert_exact(model, {"x": x})


def test_conv_integer_per_channel_weight_zero_point() -> None:
    """w_zero_point of one value per output channel (the spec allows it; ONNX Runtime's CPU kernel does not), against
    a float64 numpy reference."""
    x, w, w_zp = _ints(0, np.int8, 1, 3, 5, 5), _ints(1, np.int8, 4, 3, 2, 2), _ints(2, np.int8, 4)
    model = _one_node("ConvInteger", {"x": x}, {"w": w, "x_zp": np.int8(-3), "w_zp": w_zp}, [("y", TensorProto.INT32)])
    got = import_onnx(model)(torch.from_numpy(x)).numpy()
    xc, wc = x.astype(np.float64) + 3, w.astype(np.float64) - w_zp.reshape(4, 1, 1, 1)
    want = np.einsum("nchwij,ocij->nohw", np.lib.stride_tricks.sliding_window_view(xc, (2, 2), (2, 3)), wc)
    np.testing.assert_array_equal(got, want.astype(np.int32))


@pytest.mark.parametrize("q_dt", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_qlinear_conv_and_matmul_match_onnxruntime(q_dt: type, per_channel: bool) -> None:
    """Requantization as ONNX Runtime's: the multiplier in float32, rounded half to even, saturated; bias int32."""
    x = _ints(0, q_dt, 2, 8, 6, 6)
    w = _ints(1, np.int8, 5, 8, 3, 3)
    ws = (np.random.default_rng(2).uniform(0.001, 0.01, 5) if per_channel else np.array(0.004)).astype(np.float32)
    consts = {"xs": np.float32(0.02), "xz": q_dt(7), "w": w, "ws": ws, "wz": np.zeros(ws.shape, np.int8),
              "ys": np.float32(0.09), "yz": q_dt(3), "b": _ints(3, np.int16, 5).astype(np.int32) * 4}
    model = _one_node("QLinearConv", {"x": x}, consts, [("y", helper.np_dtype_to_tensor_dtype(np.dtype(q_dt)))],
                      pads=[1, 1, 1, 1])
    _assert_exact(model, {"x": x})
    a, b = _ints(4, q_dt, 3, 4, 32), _ints(5, np.int8, 32, 5)
    consts = {"as": np.float32(0.03), "az": q_dt(-5 if q_dt is np.int8 else 120), "b": b, "bs": ws,
              "bz": np.zeros(ws.shape, np.int8), "ys": np.float32(0.05), "yz": q_dt(2)}
    model = _one_node("QLinearMatMul", {"a": a}, consts, [("y", helper.np_dtype_to_tensor_dtype(np.dtype(q_dt)))])
    _assert_exact(model, {"a": a})


@pytest.mark.parametrize("x", [np.linspace(-3.0, 5.0, 97), np.linspace(0.5, 2.0, 40), np.zeros(8),
                               -np.abs(np.random.default_rng(0).standard_normal(50))],
                         ids=["mixed", "positive", "zeros", "negative"])
def test_dynamic_quantize_linear_matches_onnxruntime(x: np.ndarray) -> None:
    x = x.astype(np.float32).reshape(1, -1)
    model = _one_node("DynamicQuantizeLinear", {"x": x}, {}, [("y", TensorProto.UINT8), ("s", TensorProto.FLOAT),
                                                             ("z", TensorProto.UINT8)])
    _assert_exact(model, {"x": x})


# whole models, quantized by ONNX Runtime's own tool

class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.fc = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 3, 8, 8)
        y = torch.relu(self.c1(x))
        z = torch.relu(self.c2(y)) + y
        z = torch.sigmoid(z) * z
        z = torch.cat([z, nn.functional.leaky_relu(self.c3(x), 0.1)], 1)
        return torch.softmax(self.fc(nn.functional.adaptive_avg_pool2d(z, 1).flatten(1)), -1)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 16)
        att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), -1) @ x
        return self.b(torch.relu(self.a(att + x)))


_SHAPES = {"cnn": (2, 3, 8, 8), "mlp": (2, 5, 16)}


@pytest.fixture(scope="module")
def float_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for name, cls in (("cnn", _CNN), ("mlp", _MLP)):
        torch.manual_seed(0)
        f = io.BytesIO()
        torch.onnx.export(cls().eval(), torch.randn(*_SHAPES[name]), f, input_names=["x"], output_names=["y"],
                          opset_version=17, dynamo=False)
        path = tmp_path_factory.mktemp("float") / f"{name}.onnx"
        path.write_bytes(f.getvalue())
        out[name] = str(path)
    return out


def _reader(shape: tuple[int, ...]) -> object:
    class Reader(quant.CalibrationDataReader):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.it = iter([{"x": torch.randn(*shape, generator=g).numpy()} for _ in range(4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)
    return Reader()


def _compare(path: str, shape: tuple[int, ...], steps: float, fuse: bool = True) -> None:
    """The importer against ONNX Runtime on 5 inputs: within ``steps`` of the output DequantizeLinear's scale.
    ``fuse`` False: ONNX Runtime without its graph optimizations, which run a QDQ graph node by node as the spec
    defines it (with them, it fuses DQ -> op -> Q into integer kernels whose rounding differs by a step per
    layer, and those steps compound through the layers)."""
    model = onnx.load(path)
    opts = ort.SessionOptions()
    if not fuse:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    mod = import_onnx(model)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    step = float(inits[dq[-1].input[1]]) if dq and dq[-1].output[0] == "y" else 0.0
    for seed in range(5):
        x = (2 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)
        want, got = sess.run(None, {"x": x})[0], mod(torch.from_numpy(x)).numpy()
        # rtol: the float32 ops after the integer ones (a dynamic model's Mul by the scales, its bias Add), which
        # ONNX Runtime fuses into MatMulIntegerToFloat and rounds in another order: an ulp or two
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=steps * step * 1.0001 + 1e-7)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
@pytest.mark.parametrize("fmt", ["QOperator", "QDQ"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("act", ["QUInt8", "QInt8"])
def test_quantize_static_models_match_onnxruntime(float_models: dict[str, str], tmp_path, name: str, fmt: str,
                                                  per_channel: bool, act: str) -> None:
    dst = str(tmp_path / "q.onnx")
    quant.quantize_static(float_models[name], dst, _reader(_SHAPES[name]), quant_format=getattr(quant.QuantFormat, fmt),
                          per_channel=per_channel, activation_type=getattr(quant.QuantType, act),
                          weight_type=quant.QuantType.QInt8)
    ops = {n.op_type for n in onnx.load(dst).graph.node}
    if fmt == "QOperator":  # the integer kernels themselves, bit for bit
        assert ops & {"QLinearConv", "QLinearMatMul"}
        _compare(dst, _SHAPES[name], steps=0)
    else:
        _compare(dst, _SHAPES[name], steps=1, fuse=False)


@pytest.mark.parametrize("name", ["cnn", "mlp"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("weight", ["QInt8", "QUInt8"])
def test_quantize_dynamic_models_match_onnxruntime(float_models: dict[str, str], tmp_path, name: str,
                                                   per_channel: bool, weight: str) -> None:
    dst = str(tmp_path / "q.onnx")
    quant.quantize_dynamic(float_models[name], dst, per_channel=per_channel,
                           weight_type=getattr(quant.QuantType, weight))
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in onnx.load(dst).graph.node}
    _compare(dst, _SHAPES[name], steps=0)


def test_integer_ops_listed_and_others_refused_by_name() -> None:
    standard = {"MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear"}
    assert standard <= set(SUPPORTED_OPS)
    assert "com.microsoft::QLinearAdd" in SUPPORTED_CONTRIB_OPS and "com.microsoft::QGemm" in SUPPORTED_CONTRIB_OPS
    x = np.zeros((2, 3, 4), np.float32)
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "w", "r"], ["y"], name="dqlstm", domain="com.microsoft",
                            hidden_size=2)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(_ints(0, np.int8, 1, 4, 8), "w"),
                           numpy_helper.from_array(_ints(1, np.int8, 1, 2, 8), "r")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(UsageError, match="DynamicQuantizeLSTM.*dqlstm"):
        import_onnx(model)
