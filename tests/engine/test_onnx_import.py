"""overdrive's ONNX -> PyTorch importer: CNN and attention graphs against PyTorch references (also
under torch.export with dynamic shapes), Q/DQ, and the error that names an unsupported op and node."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def _model(nodes: list, inputs: list, outputs: list, inits: dict[str, np.ndarray], opset: int = 18,
           check: bool = True) -> bytes:
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    if check:  # the checker wants output shapes; the one-op models below leave them to the runtime
        onnx.checker.check_model(m)
    return m.SerializeToString()


def _attention_graph() -> tuple[bytes, dict[str, np.ndarray]]:
    """x (B, T, 32) -> LayerNorm -> per-head attention (shapes computed with Shape/Gather/Concat) -> GELU(erf)."""
    rng = np.random.default_rng(0)
    w = {"ln_w": rng.standard_normal(32).astype(np.float32), "ln_b": rng.standard_normal(32).astype(np.float32),
         "wqkv": (rng.standard_normal((32, 96)) * 0.2).astype(np.float32), "split": np.array([32, 32, 32], np.int64),
         "heads": np.array([4, 8], np.int64), "idx0": np.array(0, np.int64), "idx1": np.array(1, np.int64),
         "zero_ax": np.array([0], np.int64), "minus1": np.array([-1], np.int64), "scale": np.array(8 ** 0.5, np.float32),
         "half": np.array(0.5, np.float32), "one": np.array(1.0, np.float32), "rt2": np.array(2 ** 0.5, np.float32),
         "neg": np.array(-1e4, np.float32), "zero_i": np.array(0, np.int64)}
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln_w", "ln_b"], ["h"], name="ln", axis=-1, epsilon=1e-5),
        n("MatMul", ["h", "wqkv"], ["qkv"], name="qkv_proj"),
        n("Split", ["qkv", "split"], ["q", "k", "v"], name="split_qkv", axis=2),
        n("Shape", ["x"], ["xs"], name="shape"),
        n("Gather", ["xs", "idx0"], ["b"], name="get_b", axis=0),
        n("Gather", ["xs", "idx1"], ["t"], name="get_t", axis=0),
        n("Unsqueeze", ["b", "zero_ax"], ["b1"], name="b1"),
        n("Unsqueeze", ["t", "zero_ax"], ["t1"], name="t1"),
        n("Concat", ["b1", "t1", "heads"], ["hshape"], name="hshape", axis=0),
        n("Concat", ["b1", "t1", "minus1"], ["oshape"], name="oshape", axis=0),
        *[n("Reshape", [s, "hshape"], [s + "r"], name="r_" + s) for s in "qkv"],
        *[n("Transpose", [s + "r"], [s + "t"], name="t_" + s, perm=[0, 2, 1, 3]) for s in "qv"],
        n("Transpose", ["kr"], ["kt"], name="t_k", perm=[0, 2, 3, 1]),
        n("MatMul", ["qt", "kt"], ["s0"], name="scores"),
        n("Div", ["s0", "scale"], ["s1"], name="scale"),
        n("Equal", ["mask", "zero_i"], ["pad"], name="is_pad"),
        n("Unsqueeze", ["pad", "heads_ax"], ["pad4"], name="pad4"),
        n("Where", ["pad4", "neg", "s1"], ["s2"], name="mask"),
        n("Softmax", ["s2"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "vt"], ["o"], name="pv"),
        n("Transpose", ["o"], ["ot"], name="t_o", perm=[0, 2, 1, 3]),
        n("Reshape", ["ot", "oshape"], ["o2"], name="merge"),
        n("Div", ["o2", "rt2"], ["g0"], name="gelu_div"),
        n("Erf", ["g0"], ["g1"], name="gelu_erf"),
        n("Add", ["g1", "one"], ["g2"], name="gelu_add"),
        n("Mul", ["o2", "g2"], ["g3"], name="gelu_mul"),
        n("Mul", ["g3", "half"], ["y"], name="gelu_half"),
    ]
    w["heads_ax"] = np.array([1, 2], np.int64)
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 32]),
           helper.make_tensor_value_info("mask", TensorProto.INT64, ["B", "T"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 32])]
    return _model(nodes, ins, outs, w), w


def _attention_reference(x: torch.Tensor, mask: torch.Tensor, w: dict[str, np.ndarray]) -> torch.Tensor:
    t = {k: torch.from_numpy(v) for k, v in w.items()}
    B, T, _ = x.shape
    h = F.layer_norm(x, (32,), t["ln_w"], t["ln_b"], 1e-5)
    q, k, v = (h @ t["wqkv"]).split(32, -1)
    q, k, v = (z.reshape(B, T, 4, 8).transpose(1, 2) for z in (q, k, v))
    s = (q @ k.transpose(-2, -1)) / 8 ** 0.5
    s = s.masked_fill(mask[:, None, None, :] == 0, -1e4)
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32)
    return F.gelu(o)


def test_attention_graph_matches_pytorch_and_exports_dynamic() -> None:
    model, w = _attention_graph()
    mod = import_onnx(model)
    assert mod.input_names == ["x", "mask"]
    for B, T in ((2, 16), (3, 5)):
        x = torch.randn(B, T, 32)
        mask = torch.ones(B, T, dtype=torch.int64)
        mask[-1, T // 2:] = 0
        torch.testing.assert_close(mod(x, mask), _attention_reference(x, mask, w), atol=1e-5, rtol=1e-4)
    b, t = torch.export.Dim("b", min=1, max=64), torch.export.Dim("t", min=2, max=128)
    ep = torch.export.export(mod, (torch.randn(2, 16, 32), torch.ones(2, 16, dtype=torch.int64)),
                             dynamic_shapes=(({0: b, 1: t}, {0: b, 1: t}),))
    x, mask = torch.randn(5, 9, 32), torch.ones(5, 9, dtype=torch.int64)
    torch.testing.assert_close(ep.module()(x, mask), _attention_reference(x, mask, w), atol=1e-5, rtol=1e-4)


def test_exported_cnn_matches_pytorch(digits: torch.nn.Module, digits_onnx: bytes) -> None:
    mod = import_onnx(digits_onnx)
    for batch in (1, 4, 9):
        x = torch.randn(batch, 1, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(mod(x), digits(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("qtype,ref_dtype", [(TensorProto.INT8, torch.int8), (TensorProto.UINT8, torch.uint8)])
def test_quantize_dequantize(qtype: int, ref_dtype: torch.dtype) -> None:
    zp = np.array(0 if qtype == TensorProto.INT8 else 128, dtype=np.int8 if qtype == TensorProto.INT8 else np.uint8)
    scale = np.array([0.02, 0.05, 0.1], np.float32)  # per channel on axis 1
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q", axis=1),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq", axis=1)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
                   {"s": scale, "z": np.full(3, zp, zp.dtype)})
    x = torch.randn(2, 3, 4) * 3
    s = torch.from_numpy(scale).reshape(1, 3, 1)
    info = torch.iinfo(ref_dtype)
    ref = ((torch.round(x / s) + int(zp)).clamp(info.min, info.max) - int(zp)) * s
    torch.testing.assert_close(import_onnx(model)(x), ref)
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x.numpy()})[0], ref.numpy(), atol=1e-6)


def test_unsupported_op_names_op_and_node() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="relu0"),
             helper.make_node("NonMaxSuppression", ["h", "h"], ["y"], name="nms_head")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.INT64, [None, 3])], {})
    with pytest.raises(UsageError, match=r"ONNX operator NonMaxSuppression \(node 'nms_head'\) is not supported"):
        import_onnx(model)
    from overdrive.engine import Builder

    with pytest.raises(UsageError, match="NonMaxSuppression"):
        Builder(backend="inductor", device="cpu", profiles=[{"name": "x", "min": [1, 4, 4], "opt": [1, 4, 4],
                                                              "max": [1, 4, 4]}]).build(model)


def _single(op: str, x: np.ndarray, attrs: dict, opset: int = 18, inits: dict[str, np.ndarray] | None = None,
            extra_inputs: tuple[str, ...] = (), outputs: int = 1, x_type: int = TensorProto.FLOAT) -> bytes:
    """A one-node model ``op(x, *extra_inputs)`` with ``attrs``; outputs y0.. of unknown shape."""
    inits = inits or {}
    node = helper.make_node(op, ["x", *extra_inputs], [f"y{i}" for i in range(outputs)], name="node", **attrs)
    return _model([node], [helper.make_tensor_value_info("x", x_type, list(x.shape))],
                  [helper.make_tensor_value_info(f"y{i}", x_type, shape=None) for i in range(outputs)], inits, opset,
                  check=False)


# Each case once against ONNX Runtime (the reference): the importer had these wrong.
ORT_CASES = {
    "softmax_opset11_axis1": ("Softmax", np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32),
                              {"axis": 1}, 11, {}, ()),
    "logsoftmax_opset11_default_axis": ("LogSoftmax", np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32),
                                        {}, 11, {}, ()),
    "avgpool_uneven_pads": ("AveragePool", np.random.default_rng(2).standard_normal((1, 2, 5, 5)).astype(np.float32),
                            {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}, 18, {}, ()),
    "gather_negative_axis": ("Gather", np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float32),
                             {"axis": -1}, 18, {"idx": np.array([3, 0], np.int64)}, ("idx",)),
    "flatten_axis_rank": ("Flatten", np.random.default_rng(4).standard_normal((2, 3, 4)).astype(np.float32),
                          {"axis": 3}, 18, {}, ()),
}


@pytest.mark.parametrize("case", sorted(ORT_CASES))
def test_ops_match_onnxruntime(case: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    op, x, attrs, opset, inits, extra = ORT_CASES[case]
    model = _single(op, x, attrs, opset, inits, extra)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = import_onnx(model)(torch.from_numpy(x))
    assert tuple(out.shape) == ref.shape
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-5, rtol=1e-5)


def test_integer_div_truncates_like_onnx() -> None:
    """ONNX Div of integers truncates toward zero and stays an integer, on tensors and on host constants."""
    ort = pytest.importorskip("onnxruntime")
    x = np.array([7, -7, 9, -9], np.int64)
    model = _single("Div", x, {}, inits={"d": np.array([2, 2, 4, 4], np.int64)}, extra_inputs=("d",),
                    x_type=TensorProto.INT64)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = import_onnx(model)(torch.from_numpy(x))
    assert out.dtype == torch.int64 and out.tolist() == ref.tolist() == [3, -3, 2, -2]
    from overdrive.engine.onnx.ops import _div_np

    assert _div_np(np.array([-7, 7]), np.array([2, -2])).tolist() == [-3, -3]


def test_slice_to_int64_min_with_a_positive_step_is_empty() -> None:
    # ONNX clamps an end of INT64_MIN to 0: an empty axis (reference: ONNX Runtime); it read as "to the end"
    ort = pytest.importorskip("onnxruntime")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ints = {"s": np.array([0], np.int64), "e": np.array([-(2 ** 63)], np.int64), "a": np.array([1], np.int64)}
    model = _single("Slice", x, {}, inits=ints, extra_inputs=("s", "e", "a"))
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = import_onnx(model)(torch.from_numpy(x))
    assert tuple(out.shape) == ref.shape == (3, 0)


def test_integer_clip_keeps_integers_exact() -> None:
    """ONNX Clip of int64 stays int64 (reference: ONNX Runtime); float bounds made it float32, and 2**24 + 1 came out
    2**24 (a PASSED compare, within its tolerance)."""
    ort = pytest.importorskip("onnxruntime")
    x = np.array([16777217, 123456789, -5, 2 ** 31 + 7], np.int64)
    model = _single("Clip", x, {}, inits={"lo": np.array(0, np.int64), "hi": np.array(2 ** 31 - 1, np.int64)},
                    extra_inputs=("lo", "hi"), x_type=TensorProto.INT64)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = import_onnx(model)(torch.from_numpy(x))
    assert out.dtype == torch.int64 and out.tolist() == ref.tolist() == [16777217, 123456789, 0, 2 ** 31 - 1]


def test_split_num_outputs_with_a_remainder() -> None:
    ort = pytest.importorskip("onnxruntime")
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    model = _single("Split", x, {"axis": 1, "num_outputs": 3}, outputs=3)
    refs = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    outs = import_onnx(model)(torch.from_numpy(x))
    assert [tuple(o.shape) for o in outs] == [r.shape for r in refs] == [(2, 2), (2, 2), (2, 1)]


def test_a_constant_plus_a_symbolic_size_stays_symbolic() -> None:
    """``Add(int64 constant, Shape(x)[1])`` on host sizes (the mask code of a dynamo-exported Llama): the sum is not
    cast back to int64, which fixed the traced sequence length (torch.export: "specialized it to be a constant
    (16)"), so an engine from that ONNX could not take a dynamic sequence. Reference: numpy, at two lengths."""
    n = helper.make_node
    nodes = [n("Shape", ["x"], ["shape"]), n("Gather", ["shape", "one"], ["t"], axis=0),
             n("Add", ["one", "t"], ["t1"]),  # the constant first: the cast back to its int64 made t1 a plain int
             n("Range", ["zero", "t1", "one"], ["r"]), n("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
             n("ReduceSum", ["rf"], ["s"], keepdims=0), n("Add", ["x", "s"], ["y"])]
    inits = {"one": np.array(1, np.int64), "zero": np.array(0, np.int64)}
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t"])], inits)
    mod = import_onnx(model)
    b, t = torch.export.Dim("b", min=1, max=8), torch.export.Dim("t", min=2, max=64)
    ep = torch.export.export(mod, (torch.randn(2, 16),), dynamic_shapes=(({0: b, 1: t},),))
    for shape in ((2, 16), (3, 9)):
        x = torch.randn(*shape)
        want = x + sum(range(shape[1] + 1))  # 0 + 1 + ... + t
        torch.testing.assert_close(ep.module()(x), want)


def _mask_cast_graph() -> tuple[bytes, dict[str, np.ndarray]]:
    """Hugging Face BERT's ONNX pattern: the int64 mask ``Cast(to=FLOAT)`` and turned into an additive bias on the
    attention scores, softmax, ``p @ v``; then the hidden state ``Cast(to=FLOAT)`` into a LayerNorm (statistics in
    fp32, as T5/Llama exports do) and a projection."""
    rng = np.random.default_rng(0)
    w = {"wq": (rng.standard_normal((16, 16)) * 0.3).astype(np.float32),
         "wv": (rng.standard_normal((16, 16)) * 0.3).astype(np.float32),
         "wo": (rng.standard_normal((16, 8)) * 0.3).astype(np.float32),
         "ln_w": rng.standard_normal(16).astype(np.float32), "ln_b": rng.standard_normal(16).astype(np.float32),
         "one": np.array(1.0, np.float32), "neg": np.array(-1e4, np.float32), "ax": np.array([1], np.int64)}
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wv"], ["v"]),
        n("Transpose", ["q"], ["qt"], perm=[0, 2, 1]), n("MatMul", ["q", "qt"], ["s"]),
        n("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT), n("Sub", ["one", "mf"], ["inv"]),
        n("Mul", ["inv", "neg"], ["bias0"]), n("Unsqueeze", ["bias0", "ax"], ["bias"]),
        n("Add", ["s", "bias"], ["s2"]), n("Softmax", ["s2"], ["p"], axis=-1),
        n("MatMul", ["p", "v"], ["o"]),
        n("Cast", ["o"], ["o32"], to=TensorProto.FLOAT),
        n("LayerNormalization", ["o32", "ln_w", "ln_b"], ["h"], axis=-1, epsilon=1e-5),
        n("MatMul", ["h", "wo"], ["y"]),
    ]
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 16]),
           helper.make_tensor_value_info("mask", TensorProto.INT64, ["B", "T"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "T", 8])]
    return _model(nodes, ins, outs, w), w


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_build_keeps_the_graphs_fp32_casts_and_runs(dtype: torch.dtype) -> None:
    """A half build casts the model's weights and inputs, but the graph's own Cast(to=FLOAT) (the mask, a norm's
    input) made fp32 activations meet fp16 operands: ``overdrive build --onnx bert.onnx --fp16`` (a Hugging Face
    BERT export) failed in the importer with "expected scalar type float but found Half" at the ``p @ v`` MatMul.
    Now products run in the half dtype and norms in their input's dtype. Reference: the same graph in fp32 (the
    importer is checked against PyTorch above); tolerance the half dtype's rounding over three products."""
    model, _ = _mask_cast_graph()
    ref_mod = import_onnx(model)
    mod = import_onnx(model).to(dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 4:] = 0
    ref = ref_mod(x, mask)
    got = mod(x.to(dtype), mask)
    tol = 2e-2 if dtype == torch.float16 else 8e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_an_output_the_importer_does_not_compute_is_named() -> None:
    # MaxPool's Indices read by the graph: a KeyError surfaced as "torch.export failed ... graph break"
    x = np.random.default_rng(0).standard_normal((1, 1, 4, 4)).astype(np.float32)
    node = helper.make_node("MaxPool", ["x"], ["y", "idx"], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    model = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                    helper.make_tensor_value_info("idx", TensorProto.INT64, None)], {}, check=False)
    with pytest.raises(UsageError, match=r"ONNX node 'pool' \(MaxPool\): its output 1 \('idx'\) is read by the graph.*"
                                         r"--backend onnxruntime"):
        import_onnx(model)(torch.from_numpy(x))
