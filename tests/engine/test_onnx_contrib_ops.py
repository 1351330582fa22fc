"""ONNX Runtime's own operators (com.microsoft, and SimplifiedLayerNormalization in the default domain), as its
transformer optimizer writes them, imported and checked against ONNX Runtime's CPU kernels on random inputs:
the Gelu family, Skip(Simplified)LayerNormalization with every optional input and output,
SimplifiedLayerNormalization, FusedConv; float32 and, where ONNX Runtime's CPU runs it, float16. The fused
attention operators stay refused by name, and a malformed node is refused naming its inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import SUPPORTED_CONTRIB_OPS, import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

MS = "com.microsoft"
# float32: against ONNX Runtime's float32, absolute and relative; float16: one-to-two half ulps at these magnitudes
TOL = {np.float32: 2e-5, np.float16: 4e-3}


def _f(seed: int, *shape: int, dtype: type = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _model(op: str, inputs: list[np.ndarray | None], outputs: list[str], domain: str = MS, stats_f32: bool = False,
           **attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One ``op`` node reading graph inputs i0, i1, .. (None: an omitted optional input). ``stats_f32``: outputs
    1 and 2 (mean, inv_std_var) are float32 whatever the input's type, as ONNX Runtime declares them."""
    names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    feeds = {n: v for n, v in zip(names, inputs) if n}
    dt = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)
    node = helper.make_node(op, names, outputs, name="n", domain=domain, **attrs)
    ins = [helper.make_tensor_value_info(n, dt, v.shape) for n, v in feeds.items()]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT if stats_f32 and k in (1, 2) else dt, None)
            for k, o in enumerate(outputs) if o]
    g = helper.make_graph([node], "g", ins, outs)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    return model, feeds


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))
    got = [got] if isinstance(got, torch.Tensor) else list(got)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.numpy().dtype == w.dtype
        tol = TOL[np.float16 if w.dtype == np.float16 else np.float32]
        np.testing.assert_allclose(g.numpy().astype(np.float32), w.astype(np.float32), rtol=tol, atol=tol)


DTYPES = [np.float32, np.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ["Gelu", "FastGelu", "FastGelu+bias", "BiasGelu", "QuickGelu", "QuickGelu+alpha"])
def test_gelu_family_matches_onnxruntime(case: str, dtype: type) -> None:
    x, b = _f(1, 2, 5, 16, dtype=dtype) * 2, _f(2, 16, dtype=dtype)
    op, _, extra = case.partition("+")
    inputs = [x, b] if extra == "bias" or op == "BiasGelu" else [x]
    attrs = {"alpha": 1.1} if extra == "alpha" else {}
    _check(*_model(op, inputs, ["y"], **attrs))


SKIP_SHAPES = {"full": (2, 5, 16), "broadcast": (1, 5, 16), "2d": (5, 16)}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("skip", sorted(SKIP_SHAPES))
@pytest.mark.parametrize("optional", ["none", "beta", "bias", "beta+bias"])
def test_skip_layer_norm_matches_onnxruntime(optional: str, skip: str, dtype: type) -> None:
    x, s = _f(3, 2, 5, 16, dtype=dtype) * 3 + 1, _f(4, *SKIP_SHAPES[skip], dtype=dtype)
    gamma, beta, bias = _f(5, 16, dtype=dtype), _f(6, 16, dtype=dtype), _f(7, 16, dtype=dtype)
    inputs = [x, s, gamma, beta if "beta" in optional else None, bias if "bias" in optional else None]
    while inputs[-1] is None:
        inputs.pop()
    # ONNX Runtime's CPU kernel declares mean / inv_std_var float32 only, which it has no float16 kernel for
    outs = ["y", "mean", "inv", "sum"] if dtype == np.float32 else ["y", "", "", "sum"]
    _check(*_model("SkipLayerNormalization", inputs, outs, stats_f32=True, epsilon=1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_skip_simplified_layer_norm_matches_onnxruntime(bias: bool, dtype: type) -> None:
    x, s, gamma = _f(8, 2, 5, 16, dtype=dtype) * 3 + 1, _f(9, 2, 5, 16, dtype=dtype), _f(10, 16, dtype=dtype)
    inputs = [x, s, gamma, *([_f(11, 16, dtype=dtype)] if bias else [])]
    outs = ["y", "mean", "inv", "sum"] if dtype == np.float32 else ["y", "", "", "sum"]
    _check(*_model("SkipSimplifiedLayerNormalization", inputs, outs, stats_f32=True))  # default epsilon


def test_skip_layer_norm_default_epsilon_and_output_only() -> None:
    """Epsilon 1e-12 by default (not LayerNormalization's 1e-5): visible on rows of tiny variance."""
    x = (_f(12, 2, 3, 8) * 1e-4).astype(np.float32)
    _check(*_model("SkipLayerNormalization", [x, np.zeros_like(x), np.ones(8, np.float32)], ["y"]))


@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_norm_matches_onnxruntime(axis: int) -> None:
    """RMSNorm as ONNX Runtime writes it, in the default domain; outputs Y and float32 inv_std_var."""
    x = _f(13, 2, 5, 16) * 3
    scale = _f(14, *x.shape[axis:])
    _check(*_model("SimplifiedLayerNormalization", [x, scale], ["y", "inv"], domain="", axis=axis, epsilon=1e-6))


def test_simplified_layer_norm_fp16_output() -> None:
    x, scale = _f(15, 2, 5, 16, dtype=np.float16), _f(16, 16, dtype=np.float16)
    _check(*_model("SimplifiedLayerNormalization", [x, scale], ["y"], domain=""))


@pytest.mark.parametrize("act", ["", "Relu", "Tanh", "Sigmoid", "LeakyRelu", "Clip", "HardSigmoid"])
@pytest.mark.parametrize("z", [False, True], ids=["no_z", "z"])
def test_fused_conv_matches_onnxruntime(act: str, z: bool) -> None:
    params = {"LeakyRelu": [0.2], "Clip": [-0.5, 0.7], "HardSigmoid": [0.3, 0.4]}.get(act, [])
    x, w, b = _f(17, 1, 3, 7, 7), _f(18, 4, 3, 3, 3), _f(19, 4)
    inputs = [x, w, b, *([_f(20, 1, 4, 4, 4)] if z else [])]
    attrs = {"activation": act, **({"activation_params": params} if params else {})} if act else {}
    _check(*_model("FusedConv", inputs, ["y"], strides=[2, 2], pads=[1, 1, 1, 1], **attrs))


def test_supported_contrib_ops_are_listed() -> None:
    assert "com.microsoft::SkipLayerNormalization" in SUPPORTED_CONTRIB_OPS
    assert "com.microsoft::Attention" not in SUPPORTED_CONTRIB_OPS


@pytest.mark.parametrize("op", ["Attention", "MultiHeadAttention", "EmbedLayerNormalization", "BiasSoftmax"])
def test_fused_attention_is_refused_naming_the_op(op: str) -> None:
    model, _ = _model(op, [_f(21, 2, 4, 8), _f(22, 8, 24)], ["y"])
    with pytest.raises(UsageError, match=rf"com\.microsoft::{op} \(node 'n'\) is not supported.*runs com\.microsoft "
                                         r".*SkipLayerNormalization.*--backend onnxruntime"):
        import_onnx(model)


def test_malformed_contrib_node_is_refused_naming_its_inputs() -> None:
    model, _ = _model("SkipLayerNormalization", [_f(23, 2, 4, 8)], ["y"])
    with pytest.raises(UsageError, match=r"'n' \(com\.microsoft::SkipLayerNormalization\) has 1 inputs; expected 3 "
                                         r"to 5 \(input, skip, gamma, beta\?, bias\?\)"):
        import_onnx(model)


def test_bad_fused_conv_activation_is_refused_naming_it() -> None:
    model, feeds = _model("FusedConv", [_f(24, 1, 2, 5, 5), _f(25, 2, 2, 3, 3)], ["y"], activation="Swish")
    with pytest.raises(UsageError, match=r"'n' \(com\.microsoft::FusedConv\).*activation='Swish'.*expected one of"):
        import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))


def _tiny_bert(path, attn: str) -> dict[str, np.ndarray]:
    """A one-layer BERT from a config (random weights, nothing downloaded) exported to ``path``; its feeds."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, attn_implementation=attn)
    bert = transformers.BertModel(cfg).eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state

    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 100, (2, 10)), "attention_mask": np.ones((2, 10), np.int64),
             "token_type_ids": np.zeros((2, 10), np.int64)}
    torch.onnx.export(Hidden(), tuple(torch.from_numpy(v) for v in feeds.values()), str(path),
                      input_names=list(feeds), output_names=["hidden"], opset_version=17, dynamo=False)
    return feeds


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_transformer_optimizer_bert_matches_onnxruntime(tmp_path, fp16: bool) -> None:
    """onnxruntime.transformers.optimizer's BERT output (SkipLayerNormalization, a Gelu), as users save it and
    convert it to float16, runs and matches ONNX Runtime; it was refused at its first com.microsoft node."""
    from onnxruntime.transformers.optimizer import optimize_model

    feeds = _tiny_bert(tmp_path / "bert.onnx", "sdpa")
    opt = optimize_model(str(tmp_path / "bert.onnx"), model_type="bert", num_heads=4, hidden_size=32, opt_level=0,
                         use_gpu=False, only_onnxruntime=False)
    if fp16:
        opt.convert_float_to_float16(keep_io_types=False)
    opt.save_model_to_file(str(tmp_path / "opt.onnx"))
    model = onnx.load(str(tmp_path / "opt.onnx"))
    written = {n.op_type for n in model.graph.node if n.domain == MS}
    assert "SkipLayerNormalization" in written and written & {"Gelu", "BiasGelu", "FastGelu"}, written
    want = ort.InferenceSession(str(tmp_path / "opt.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))
    assert got.numpy().dtype == want.dtype
    tol = 1e-2 if fp16 else 1e-5  # fp16: a half ulp of the hidden state's magnitude (~4) is 2e-3, summed over layers
    np.testing.assert_allclose(got.numpy().astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


def test_transformer_optimizer_fused_attention_is_refused_naming_it(tmp_path) -> None:
    """Eager attention is fused into com.microsoft::Attention: refused by name, with the optimizer's switch."""
    from onnxruntime.transformers.optimizer import optimize_model

    _tiny_bert(tmp_path / "bert.onnx", "eager")
    opt = optimize_model(str(tmp_path / "bert.onnx"), model_type="bert", num_heads=4, hidden_size=32, opt_level=0,
                         use_gpu=False, only_onnxruntime=False)
    with pytest.raises(UsageError, match=r"com\.microsoft::Attention \(node .*enable_attention"):
        import_onnx(opt.model)
