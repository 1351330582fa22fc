"""The fused operators ONNX Runtime's graph optimizer writes into quantized models (a model saved with
``SessionOptions.optimized_model_filepath`` at level EXTENDED), imported and checked against ONNX Runtime:
com.microsoft DynamicQuantizeMatMul, MatMulIntegerToFloat, QAttention (from ``quantize_dynamic`` of the transformer
optimizer's Attention), FusedMatMul, and QLinearAveragePool (``quantize_static``'s QOperator pooling).

Tolerances: QLinearAveragePool's integers bit for bit; the float32 outputs of the integer GEMMs (exact products,
one float32 scale and bias) within an ulp or two, ONNX Runtime's MLAS output stage fusing the multiply-add;
QAttention's softmax and products within float32 rounding (rtol 1e-5)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import SUPPORTED_CONTRIB_OPS, import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
quant = pytest.importorskip("onnxruntime.quantization")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

MS = "com.microsoft"


def _ints(seed: int, dtype: type, *shape: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max + 1, shape).astype(dtype)


def _floats(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _node_model(op: str, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray], inputs: list[str],
                outs: list[tuple[str, int]], **attrs) -> onnx.ModelProto:
    """One com.microsoft ``op`` node reading ``inputs`` (names of ``feeds`` and ``consts``; "" for an omitted one)."""
    node = helper.make_node(op, inputs, [o for o, _ in outs], name="n", domain=MS, **attrs)
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                      for k, v in feeds.items()],
        [helper.make_tensor_value_info(o, t, None) for o, t in outs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])


def _run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))
    got = [got] if isinstance(got, torch.Tensor) else list(got)
    return [g.numpy() for g in got], want


def _close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-6) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


# single nodes

@pytest.mark.parametrize("b_dt", [np.int8, np.uint8])
@pytest.mark.parametrize("per_col", [False, True], ids=["per_tensor", "per_column"])
def test_dynamic_quantize_matmul_matches_onnxruntime(b_dt: type, per_col: bool) -> None:
    """A (B, T, K) quantized at run time to uint8, B (K, N) 8-bit, scale and zero point per tensor or per column,
    a bias."""
    a, b = 3 * _floats(0, 2, 5, 48), _ints(1, b_dt, 48, 6)
    scale = (np.random.default_rng(2).uniform(0.001, 0.01, 6) if per_col else np.array([0.004])).astype(np.float32)
    zp = _ints(3, b_dt, 6) if per_col else _ints(3, b_dt, 1)
    consts = {"b": b, "s": scale, "z": zp, "bias": _floats(4, 6)}
    model = _node_model("DynamicQuantizeMatMul", {"a": a}, consts, ["a", "b", "s", "z", "bias"],
                        [("y", TensorProto.FLOAT)])
    got, want = _run_both(model, {"a": a})
    _close(got[0], want[0])


@pytest.mark.parametrize("b_dt", [np.int8, np.uint8])
def test_matmul_integer_to_float_matches_onnxruntime(b_dt: type) -> None:
    """A already uint8 with its scale and zero point as graph inputs (DynamicQuantizeLinear's outputs in a model);
    B per column."""
    a = _ints(0, np.uint8, 3, 4, 40)
    feeds = {"a": a, "as": np.array(0.02, np.float32), "az": np.array(117, np.uint8)}
    consts = {"b": _ints(1, b_dt, 40, 5), "bs": np.random.default_rng(2).uniform(0.001, 0.01, 5).astype(np.float32),
              "bz": _ints(3, b_dt, 5), "bias": _floats(4, 5)}
    model = _node_model("MatMulIntegerToFloat", feeds, consts, ["a", "b", "as", "bs", "az", "bz", "bias"],
                        [("y", TensorProto.FLOAT)])
    got, want = _run_both(model, feeds)
    _close(got[0], want[0])


def test_matmul_integer_to_float_refuses_a_per_column_scale() -> None:
    a = _ints(0, np.uint8, 2, 4)
    model = _node_model("MatMulIntegerToFloat", {"a": a}, {"b": _ints(1, np.int8, 4, 3),
                                                            "as": np.full(4, 0.1, np.float32), "bs": np.float32(0.1)},
                        ["a", "b", "as", "bs"], [("y", TensorProto.FLOAT)])
    with pytest.raises(UsageError, match=r"MatMulIntegerToFloat a_scale of 4 values.*per tensor"):
        import_onnx(model)(torch.from_numpy(a))


def _qattention(mask: np.ndarray | None, *, unidirectional: int = 0, per_col: bool = False, b_dt: type = np.int8,
                **attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """QAttention over x (2, 6, 16) uint8 with 4 heads of 4 (hidden 16), its weight (16, 48)."""
    x = _ints(0, np.uint8, 2, 6, 16)
    cols = 48 if per_col else 1
    consts = {"w": _ints(1, b_dt, 16, 48), "bias": _floats(2, 48),
              "xs": np.float32(0.05), "ws": np.random.default_rng(3).uniform(0.002, 0.02, cols).astype(np.float32),
              "xz": np.uint8(121), "wz": _ints(4, b_dt, cols)}
    feeds = {"x": x}
    if mask is not None:
        feeds["mask"] = mask.astype(np.int32)
    inputs = ["x", "w", "bias", "xs", "ws", "mask" if mask is not None else "", "xz", "wz"]
    outs = [("y", TensorProto.FLOAT), ("present", TensorProto.FLOAT)]  # present: (2, B, nh, S, hs), K and V
    model = _node_model("QAttention", feeds, consts, inputs, outs, num_heads=4,
                        unidirectional=unidirectional, **attrs)
    return model, feeds


_RAW = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
_MASKS = {
    "none": None, "end": np.array([4, 6]), "end_zero": np.array([0, 3]), "end_start": np.array([5, 6, 1, 2]),
    "raw_2d": _RAW, "raw_3d": np.tril(np.ones((6, 6), np.int64))[None].repeat(2, 0) * _RAW[:, None, :],
}


@pytest.mark.parametrize("mask", sorted(_MASKS))
def test_qattention_masks_match_onnxruntime(mask: str) -> None:
    """Every mask form ONNX Runtime's CPU kernel takes but the 4-D one; a row with every key masked (end 0) gives
    the mean of the values over -10000-shifted scores, as ONNX Runtime does."""
    model, feeds = _qattention(_MASKS[mask])
    got, want = _run_both(model, feeds)
    for g, w in zip(got, want, strict=True):
        _close(g, w, rtol=1e-5)


@pytest.mark.parametrize("case", ["unidirectional", "per_column_uint8", "scale"])
def test_qattention_attributes_match_onnxruntime(case: str) -> None:
    kw = {"unidirectional": {"unidirectional": 1}, "per_column_uint8": {"per_col": True, "b_dt": np.uint8},
          "scale": {"scale": 0.3}}[case]
    model, feeds = _qattention(np.array([5, 3]), **kw)
    got, want = _run_both(model, feeds)
    _close(got[0], want[0], rtol=1e-5)


def test_qattention_refuses_past_and_4d_masks_by_name() -> None:
    model, feeds = _qattention(None)
    node = model.graph.node[0]
    node.input.append("past")
    model.graph.input.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, 2, 4, 3, 4]))
    with pytest.raises(UsageError, match=r"'n'.*QAttention with a past state"):
        import_onnx(model)(torch.from_numpy(feeds["x"]), torch.zeros(2, 2, 4, 3, 4))
    model, feeds = _qattention(np.ones((2, 1, 6, 6)))
    with pytest.raises(UsageError, match=r"QAttention mask_index of shape \(2, 1, 6, 6\) is not supported"):
        import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))


@pytest.mark.parametrize("attrs", [{}, {"transA": 1}, {"transB": 1, "alpha": 0.125}, {"transBatchA": 1},
                                   {"transBatchB": 1, "transB": 1}, {"transBatchA": 1, "transA": 1, "alpha": 2.0}],
                         ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()) or "plain")
def test_fused_matmul_matches_onnxruntime(attrs: dict) -> None:
    """A (2, 3, M 5, K 4) @ B (2, 3, K, N 6) as stored: transBatch* puts the matrix row axis first."""
    a_shape = {(0, 0): (2, 3, 5, 4), (1, 0): (2, 3, 4, 5), (0, 1): (5, 2, 3, 4), (1, 1): (4, 2, 3, 5)}
    b_shape = {(0, 0): (2, 3, 4, 6), (1, 0): (2, 3, 6, 4), (0, 1): (4, 2, 3, 6), (1, 1): (6, 2, 3, 4)}
    feeds = {"a": _floats(0, *a_shape[attrs.get("transA", 0), attrs.get("transBatchA", 0)]),
             "b": _floats(1, *b_shape[attrs.get("transB", 0), attrs.get("transBatchB", 0)])}
    model = _node_model("FusedMatMul", feeds, {}, ["a", "b"], [("y", TensorProto.FLOAT)], **attrs)
    got, want = _run_both(model, feeds)
    _close(got[0], want[0], rtol=1e-5)


@pytest.mark.parametrize("q_dt", [np.uint8, np.int8])
@pytest.mark.parametrize("case", ["plain", "pads_exclude", "pads_include", "ceil", "channels_last", "same_upper"])
def test_qlinear_average_pool_matches_onnxruntime(q_dt: type, case: str) -> None:
    attrs = {"plain": {"kernel_shape": [2, 2], "strides": [2, 2]},
             "pads_exclude": {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
             "pads_include": {"kernel_shape": [3, 3], "pads": [1, 0, 1, 2], "count_include_pad": 1},
             "ceil": {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1},
             "channels_last": {"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 1, 1, 1], "channels_last": 1},
             "same_upper": {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}}[case]
    x = _ints(0, q_dt, 2, 7, 9, 3) if case == "channels_last" else _ints(0, q_dt, 2, 3, 7, 9)
    consts = {"xs": np.float32(0.037), "xz": q_dt(5), "ys": np.float32(0.021), "yz": q_dt(-3 if q_dt is np.int8 else 9)}
    model = _node_model("QLinearAveragePool", {"x": x}, consts, ["x", "xs", "xz", "ys", "yz"],
                        [("y", helper.np_dtype_to_tensor_dtype(np.dtype(q_dt)))], **attrs)
    got, want = _run_both(model, {"x": x})
    assert got[0].dtype == want[0].dtype
    np.testing.assert_array_equal(got[0], want[0])


# whole models, quantized by ONNX Runtime's tool, then saved by its graph optimizer

def _optimized(src: str, dst: str) -> onnx.ModelProto:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = dst
    ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    return onnx.load(dst)


def _ms_ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node if n.domain == MS}


def _compare(path: str, feeds: dict[str, np.ndarray], rtol: float) -> None:
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = import_onnx(path)(*(torch.from_numpy(v) for v in feeds.values()))
    _close(got.numpy(), want, rtol=rtol)


class _Encoder(nn.Module):
    """A BERT layer written out: separate q / k / v Linears (ONNX Runtime's optimizer turns them into one
    DynamicQuantizeLinear feeding three MatMulIntegerToFloat, or into Attention)."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.f1, self.f2 = nn.Linear(hidden, 64), nn.Linear(64, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x (B, T, H), mask (B, T) 0/1
        b, t, h = x.shape
        d = h // self.heads
        q, k, v = (f(x).view(b, t, self.heads, d).transpose(1, 2) for f in (self.q, self.k, self.v))  # (B, nh, T, d)
        scores = q @ k.transpose(-1, -2) / d ** 0.5 + (1.0 - mask[:, None, None, :].float()) * -10000.0
        att = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, h)
        x = self.ln1(x + self.o(att))
        return self.ln2(x + self.f2(nn.functional.gelu(self.f1(x))))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    f = io.BytesIO()
    x, mask = torch.randn(2, 7, 32), torch.ones(2, 7, dtype=torch.long)
    torch.onnx.export(_Encoder().eval(), (x, mask), f, input_names=["x", "mask"], opset_version=14, dynamo=False,
                      dynamic_axes={"x": {0: "b", 1: "t"}, "mask": {0: "b", 1: "t"}})
    path = tmp_path_factory.mktemp("enc") / "enc.onnx"
    path.write_bytes(f.getvalue())
    return str(path)


def _encoder_feeds() -> dict[str, np.ndarray]:
    mask = np.ones((2, 7), np.int64)
    mask[1, 4:] = 0
    return {"x": _floats(7, 2, 7, 32), "mask": mask}


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_optimized_dynamic_encoder_matches_onnxruntime(encoder: str, tmp_path, per_channel: bool) -> None:
    """quantize_dynamic, then ONNX Runtime's EXTENDED optimizations: DynamicQuantizeMatMul, MatMulIntegerToFloat."""
    q, opt = str(tmp_path / "q.onnx"), str(tmp_path / "opt.onnx")
    quant.quantize_dynamic(encoder, q, per_channel=per_channel, weight_type=quant.QuantType.QInt8)
    assert {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"} <= _ms_ops(_optimized(q, opt))
    _compare(opt, _encoder_feeds(), rtol=1e-5)


@pytest.mark.parametrize("raw_mask", [False, True], ids=["mask_index", "raw_mask"])
def test_optimized_qattention_encoder_matches_onnxruntime(encoder: str, tmp_path, raw_mask: bool) -> None:
    """The transformer optimizer's Attention (1-D mask_index from ReduceSum, or the raw 2-D mask), quantize_dynamic's
    QAttention, then ONNX Runtime's EXTENDED optimizations."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    fo = FusionOptions("bert")
    fo.use_raw_attention_mask(raw_mask)
    fused, q, opt = (str(tmp_path / n) for n in ("fused.onnx", "q.onnx", "opt.onnx"))
    optimizer.optimize_model(encoder, model_type="bert", num_heads=4, hidden_size=32, opt_level=0,
                             optimization_options=fo).save_model_to_file(fused)
    quant.quantize_dynamic(fused, q, weight_type=quant.QuantType.QInt8,
                           extra_options={"DefaultTensorType": TensorProto.FLOAT})
    assert "QAttention" in _ms_ops(_optimized(q, opt))
    _compare(opt, _encoder_feeds(), rtol=1e-5)


def test_optimized_torch_transformer_layer_matches_onnxruntime(tmp_path) -> None:
    """nn.TransformerEncoderLayer (packed in_proj): DynamicQuantizeMatMul and FusedMatMul after the optimizer."""
    torch.manual_seed(0)
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.layer(x, src_key_padding_mask=mask == 0)

    f = io.BytesIO()
    torch.onnx.export(Net().eval(), (torch.randn(2, 7, 32), torch.ones(2, 7, dtype=torch.long)), f,
                      input_names=["x", "mask"], opset_version=14, dynamo=False)
    src, q, opt = (str(tmp_path / n) for n in ("f.onnx", "q.onnx", "opt.onnx"))
    with open(src, "wb") as fh:
        fh.write(f.getvalue())
    quant.quantize_dynamic(src, q, weight_type=quant.QuantType.QUInt8)
    assert {"DynamicQuantizeMatMul", "FusedMatMul"} <= _ms_ops(_optimized(q, opt))
    feeds = _encoder_feeds()
    _compare(opt, {"x": _floats(8, 2, 7, 32), "mask": feeds["mask"]}, rtol=1e-5)


def test_static_qoperator_cnn_with_average_pool_matches_onnxruntime(tmp_path) -> None:
    """quantize_static (QOperator) of a CNN with AveragePool writes com.microsoft QLinearAveragePool: bit for bit."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(3, 2, padding=1), nn.Conv2d(8, 4, 1))
    f = io.BytesIO()
    torch.onnx.export(net.eval(), (torch.randn(1, 3, 9, 9),), f, input_names=["x"], opset_version=14, dynamo=False)
    src, q = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    with open(src, "wb") as fh:
        fh.write(f.getvalue())

    class Reader(quant.CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"x": _floats(s, 1, 3, 9, 9)} for s in range(4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    quant.quantize_static(src, q, Reader(), quant_format=quant.QuantFormat.QOperator)
    assert "QLinearAveragePool" in _ms_ops(onnx.load(q))
    for seed in range(3):
        x = 2 * _floats(10 + seed, 1, 3, 9, 9)
        want = ort.InferenceSession(q, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(import_onnx(q)(torch.from_numpy(x)).numpy(), want)


def test_fused_integer_ops_listed() -> None:
    for op in ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "FusedMatMul", "QLinearAveragePool"):
        assert f"{MS}::{op}" in SUPPORTED_CONTRIB_OPS
