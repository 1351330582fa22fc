"""The ops and cases a sweep of exported models (Hugging Face BERT, DistilBERT, RoBERTa, GPT-2, T5 encoder, ViT,
Swin, MobileNetV2, Whisper encoder; torchvision-style CNN blocks) found missing or wrong in overdrive's ONNX
importer, each checked against ONNX Runtime on a one-node graph; the host shape math under ``torch.export``
with a dynamic batch; and three small whole models (the sweep's table is in src/overdrive/engine/README.md)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

_ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
         np.dtype(np.int32): TensorProto.INT32, np.dtype(np.bool_): TensorProto.BOOL}
_R = np.random.default_rng(0)


def _f(*shape: int) -> np.ndarray:
    return _R.standard_normal(shape).astype(np.float32)


def _one_node(op: str, inputs: list[tuple[str, np.ndarray | None]], attrs: dict, out_type: int, outputs: int = 1,
              opset: int = 18) -> tuple[bytes, dict[str, np.ndarray]]:
    """``op`` over ``inputs`` (name, value): names starting with ``c`` are initializers, "" an absent optional
    input, the rest graph inputs. Returns the model and the graph inputs' values."""
    feeds = {n: v for n, v in inputs if n and not n.startswith("c")}
    inits = [numpy_helper.from_array(v, n) for n, v in inputs if n.startswith("c")]
    node = helper.make_node(op, [n for n, _ in inputs], [f"y{i}" for i in range(outputs)], name="node", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, _ELEM[v.dtype], list(v.shape))
                                        for n, v in feeds.items()],
                          [helper.make_tensor_value_info(f"y{i}", out_type, shape=None) for i in range(outputs)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return m.SerializeToString(), feeds


F32, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
_NAN = np.array([1.0, np.nan, -np.inf, 2.0], np.float32)
# name: (op, inputs, attrs, output type[, opset]); each of these ops was missing (an import error) or wrong
OP_CASES = {
    # transformers' masks (BERT, ViT, T5, GPT-2's causal mask, RoBERTa's position ids)
    "greater_or_equal": ("GreaterOrEqual", [("x", _f(3, 4)), ("c", np.zeros(4, np.float32))], {}, B),
    "less_or_equal": ("LessOrEqual", [("x", np.array([[1, 5, 3]], np.int64)), ("c", np.array([3], np.int64))], {}, B),
    "isnan": ("IsNaN", [("x", _NAN)], {}, B),
    "isinf_positive_only": ("IsInf", [("x", _NAN * np.float32(-1))], {"detect_negative": 0}, B),
    "cumsum": ("CumSum", [("x", _f(2, 5)), ("c", np.array(1, np.int64))], {}, F32),
    "cumsum_int_exclusive_reverse": ("CumSum", [("x", np.array([[1, 2, 3, 4]], np.int64)),
                                                ("c", np.array(-1, np.int64))], {"exclusive": 1, "reverse": 1}, I64),
    "gather_elements_negative_index": ("GatherElements", [("x", _f(3, 4)), ("c", np.array([[0, -1], [3, 1], [-4, 2]],
                                                                                              np.int64))], {"axis": 1}, F32),
    "gather_nd": ("GatherND", [("x", _f(3, 4, 5)), ("c", np.array([[0, 1], [2, -1]], np.int64))], {}, F32),
    "gather_nd_batch_dims": ("GatherND", [("x", _f(2, 4, 5)), ("c", np.array([[[3], [0]], [[1], [1]]], np.int64))],
                             {"batch_dims": 1}, F32),
    "mod_int": ("Mod", [("x", np.array([7, -7, 7, -7], np.int64)), ("c", np.array([3, 3, -3, -3], np.int64))], {}, I64),
    "mod_fmod_float": ("Mod", [("x", np.array([7.5, -7.5], np.float32)), ("c", np.array([2.0, 2.0], np.float32))],
                       {"fmod": 1}, F32),
    "trilu_lower": ("Trilu", [("x", _f(2, 4, 4)), ("c", np.array(1, np.int64))], {"upper": 0}, F32),
    "max_of_three": ("Max", [("x", _f(2, 3)), ("c1", _f(3)), ("c2", _f(2, 1))], {}, F32),
    "mean_of_three": ("Mean", [("x", _f(2, 3)), ("c1", _f(3)), ("c2", _f(2, 1))], {}, F32),
    "sum_of_one": ("Sum", [("x", _f(2, 3))], {}, F32),
    # torchvision-style CNN blocks
    "instance_norm": ("InstanceNormalization", [("x", _f(2, 3, 5, 5)), ("c1", _f(3)), ("c2", _f(3))],
                      {"epsilon": 1e-3}, F32),
    "group_norm_opset18_per_group": ("GroupNormalization", [("x", _f(2, 6, 4, 4)), ("c1", _f(3)), ("c2", _f(3))],
                                     {"num_groups": 3}, F32, 18),
    "group_norm_opset21_per_channel": ("GroupNormalization", [("x", _f(2, 6, 4, 4)), ("c1", _f(6)), ("c2", _f(6))],
                                       {"num_groups": 3}, F32, 21),
    "conv_transpose": ("ConvTranspose", [("x", _f(2, 4, 5, 5)), ("c1", _f(4, 3, 3, 3)), ("c2", _f(3))],
                       {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, F32),
    "conv_transpose_groups_dilation_uneven_pads": ("ConvTranspose", [("x", _f(1, 4, 5, 6)), ("c1", _f(4, 2, 3, 2))],
                                                   {"strides": [2, 3], "dilations": [2, 1], "group": 2,
                                                    "pads": [0, 1, 2, 0]}, F32),
    "conv_transpose_1d": ("ConvTranspose", [("x", _f(2, 3, 7)), ("c1", _f(3, 5, 4))], {"strides": [3]}, F32),
    "elu": ("Elu", [("x", _f(3, 4))], {"alpha": 0.7}, F32),
    "selu": ("Selu", [("x", _f(3, 4))], {}, F32),
    "mish": ("Mish", [("x", _f(3, 4))], {}, F32),
    "prelu": ("PRelu", [("x", _f(2, 3, 4)), ("c", _f(3, 1))], {}, F32),
    "tile": ("Tile", [("x", _f(2, 3)), ("c", np.array([2, 1], np.int64))], {}, F32),
    "xor": ("Xor", [("x", np.array([True, True, False, False])), ("c", np.array([True, False, True, False]))], {}, B),
    "sign": ("Sign", [("x", np.array([-2.0, 0.0, 3.0], np.float32))], {}, F32),
    "round_half_to_even": ("Round", [("x", np.array([0.5, 1.5, 2.5, -0.5, -1.7], np.float32))], {}, F32),
    "sin": ("Sin", [("x", _f(5))], {}, F32),
    "cos": ("Cos", [("x", _f(5))], {}, F32),
    # Resize as the TorchScript and dynamo exporters write F.interpolate
    "resize_nearest_scales": ("Resize", [("x", _f(1, 2, 3, 4)), ("", None), ("c", np.array([1, 1, 2, 3], np.float32))],
                              {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                               "nearest_mode": "floor"}, F32),
    "resize_nearest_exact": ("Resize", [("x", _f(1, 2, 5, 4)), ("", None), ("c", np.array([1, 1, 0.6, 2], np.float32))],
                             {"mode": "nearest", "coordinate_transformation_mode": "half_pixel",
                              "nearest_mode": "round_prefer_ceil"}, F32),
    "resize_linear_sizes": ("Resize", [("x", _f(2, 3, 5, 7)), ("", None), ("", None),
                                       ("c", np.array([2, 3, 8, 4], np.int64))],
                            {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}, F32),
    "resize_linear_align_corners": ("Resize", [("x", _f(1, 2, 4, 4)), ("", None),
                                               ("c", np.array([1, 1, 2, 2], np.float32))],
                                    {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, F32),
    "resize_cubic": ("Resize", [("x", _f(1, 2, 4, 5)), ("", None), ("c", np.array([1, 1, 2, 2], np.float32))],
                     {"mode": "cubic", "coordinate_transformation_mode": "half_pixel"}, F32),
    "resize_linear_1d": ("Resize", [("x", _f(2, 3, 6)), ("", None), ("c", np.array([1, 1, 1.5], np.float32))],
                         {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, F32),
    "resize_axes_opset18": ("Resize", [("x", _f(1, 2, 3, 4)), ("", None), ("c", np.array([2, 2], np.float32))],
                            {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                             "nearest_mode": "floor", "axes": [2, 3]}, F32),
    # Slice with a negative step (HF MobileNetV2's TF-style padding reverses its pads so)
    "slice_negative_step": ("Slice", [("x", _f(4, 6)), ("c1", np.array([-1, 4], np.int64)),
                                      ("c2", np.array([-2**63, 0], np.int64)), ("c3", np.array([0, 1], np.int64)),
                                      ("c4", np.array([-1, -2], np.int64))], {}, F32),
    "slice_negative_step_clamped": ("Slice", [("x", _f(5)), ("c1", np.array([10], np.int64)),
                                              ("c2", np.array([-7], np.int64)), ("c3", np.array([0], np.int64)),
                                              ("c4", np.array([-3], np.int64))], {}, F32),
}


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_op_matches_onnxruntime(case: str) -> None:
    op, inputs, attrs, out_type, *opset = OP_CASES[case]
    model, feeds = _one_node(op, inputs, attrs, out_type, opset=opset[0] if opset else 18)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    out = import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))
    assert tuple(out.shape) == ref.shape
    if ref.dtype.kind == "f":
        np.testing.assert_allclose(out.numpy(), ref, atol=1e-5, rtol=1e-5)
    else:
        assert out.numpy().dtype == ref.dtype
        np.testing.assert_array_equal(out.numpy(), ref)


def test_slice_negative_step_on_host_shapes() -> None:
    """Shape -> Slice(step -1) -> Reshape: the reversed shape stays a host array (numpy's own negative step, with
    ONNX's end of -1 meaning 'past the first element', not Python's 'the last one')."""
    n = helper.make_node
    nodes = [n("Shape", ["x"], ["s"]), n("Slice", ["s", "st", "en", "ax", "sp"], ["r"]), n("Reshape", ["x", "r"], ["y"])]
    inits = {"st": np.array([-1], np.int64), "en": np.array([-4], np.int64), "ax": np.array([0], np.int64),
             "sp": np.array([-1], np.int64)}
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [2, 3, 4])],
                          [helper.make_tensor_value_info("y", F32, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    x = _f(2, 3, 4)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = import_onnx(model)(torch.from_numpy(x))
    assert ref.shape == tuple(out.shape) == (4, 3, 2)
    np.testing.assert_array_equal(out.numpy(), ref)


def test_resize_unsupported_mode_names_it() -> None:
    model, feeds = _one_node("Resize", [("x", _f(1, 1, 2, 2)), ("", None), ("c", np.array([1, 1, 2, 2], np.float32))],
                             {"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize"}, F32)
    with pytest.raises(UsageError, match="Resize nearest with coordinate_transformation_mode='tf_crop_and_resize'"):
        import_onnx(model)(torch.from_numpy(feeds["x"]))


def _shape_graphs() -> dict[str, tuple[bytes, tuple[int, ...]]]:
    """Small graphs whose host shape math meets a dynamic batch under torch.export: name -> (model, x shape)."""
    n, out = helper.make_node, {}
    scalar0 = numpy_helper.from_array(np.array(0, np.int64), "i0")
    # Range(0, batch, 1): np.arange on the symbolic batch specialized it to the traced size (BERT, ViT, Swin)
    g = helper.make_graph([n("Shape", ["x"], ["s"]), n("Gather", ["s", "i0"], ["b"], axis=0),
                           n("Range", ["zero", "b", "one"], ["r"]), n("Cast", ["r"], ["rf"], to=F32),
                           n("Unsqueeze", ["rf", "ax1"], ["ru"]), n("Add", ["x", "ru"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F32, ["B", 4])], [helper.make_tensor_value_info("y", F32, None)],
                          [scalar0, numpy_helper.from_array(np.array(0, np.int64), "zero"),
                           numpy_helper.from_array(np.array(1, np.int64), "one"),
                           numpy_helper.from_array(np.array([1], np.int64), "ax1")])
    out["range_to_batch"] = (g, (3, 4))
    # Mul and Div of a 0-d symbolic size: numpy hands back a bare SymInt, which had no .dtype (Swin, TorchScript)
    # (Swin's window count, B * nW / nW, under the TorchScript exporter)
    g = helper.make_graph([n("Shape", ["x"], ["s"]), n("Gather", ["s", "i0"], ["b"], axis=0),
                           n("Mul", ["b", "two"], ["b2"]), n("Div", ["b2", "two"], ["h"]),
                           n("Unsqueeze", ["h", "ax0"], ["h1"]), n("Concat", ["h1", "rest"], ["shape"], axis=0),
                           n("Reshape", ["x", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F32, ["B", 6])], [helper.make_tensor_value_info("y", F32, None)],
                          [scalar0, numpy_helper.from_array(np.array(2, np.int64), "two"),
                           numpy_helper.from_array(np.array([0], np.int64), "ax0"),
                           numpy_helper.from_array(np.array([3, 2], np.int64), "rest")])
    out["arith_on_symbolic_size"] = (g, (4, 6))
    # Resize with its scales as a float initializer: read as numbers, it must not become a (fake) buffer
    g = helper.make_graph([n("Resize", ["x", "", "scales"], ["y"], mode="nearest",
                             coordinate_transformation_mode="asymmetric", nearest_mode="floor")], "g",
                          [helper.make_tensor_value_info("x", F32, ["B", 2, 3, 3])], [helper.make_tensor_value_info("y", F32, None)],
                          [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    out["resize_scales_initializer"] = (g, (2, 2, 3, 3))
    return {k: (helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(), s)
            for k, (g, s) in out.items()}


@pytest.mark.parametrize("case", ["range_to_batch", "arith_on_symbolic_size", "resize_scales_initializer"])
def test_host_shape_math_exports_with_dynamic_batch(case: str) -> None:
    model, shape = _shape_graphs()[case]
    mod = import_onnx(model)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(mod, (torch.randn(*shape),), dynamic_shapes=(({0: batch},),))
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for b in (1, 5):
        x = np.random.default_rng(b).standard_normal((b, *shape[1:])).astype(np.float32)
        np.testing.assert_allclose(ep.module()(torch.from_numpy(x)).numpy(), sess.run(None, {"x": x})[0], atol=1e-6)


# ---- whole models --------------------------------------------------------------------------------------


class _Blocks(nn.Module):
    """torchvision-style pieces: depthwise-separable conv, SE with hardsigmoid, hardswish, SiLU, GroupNorm,
    InstanceNorm, ConvTranspose, nearest/bilinear interpolate, concat skips, adaptive pools."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.ReLU6(), nn.Conv2d(16, 16, 1))
        self.se1, self.se2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.down, self.gn, self.inorm = nn.Conv2d(16, 32, 3, 2, 1), nn.GroupNorm(4, 32), nn.InstanceNorm2d(32, affine=True)
        self.up = nn.ConvTranspose2d(32, 16, 4, 2, 1)
        self.head = nn.Linear(32 + 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)                                               # (B, 16, 16, 16)
        d = self.dw(h)
        d = F.silu(d * F.hardsigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(d, 1))))))
        y = F.elu(self.inorm(self.gn(self.down(d))))                   # (B, 32, 8, 8)
        u = torch.cat([self.up(y) + h, d], 1)                          # (B, 32, 16, 16)
        z = F.interpolate(y, scale_factor=2, mode="nearest") * F.interpolate(y, size=(16, 16), mode="bilinear")
        return self.head(torch.cat([F.adaptive_avg_pool2d(u, 1).flatten(1), F.adaptive_max_pool2d(z, 1).flatten(1)], 1))


def _export_ts(model: nn.Module, example: tuple[torch.Tensor, ...], names: list[str]) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example, buf, dynamo=False, input_names=names, opset_version=17,
                          dynamic_axes={n: {0: "batch"} for n in names})
    return buf.getvalue()


def _check_against_ort(model_bytes: bytes, make_inputs, eager: nn.Module | None = None) -> None:
    mod = import_onnx(model_bytes)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for b in (1, 3):
        xs = make_inputs(b)
        with torch.no_grad():
            out = mod(*xs)
            refs = [torch.from_numpy(r) for r in sess.run(None, {n: x.numpy() for n, x in zip(names, xs)})]
            if eager is not None:
                refs.append(eager(*xs))
                out = (out, out) if isinstance(out, torch.Tensor) else out
        for o, r in zip(out if isinstance(out, tuple) else (out,), refs):
            torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-4)


def test_cnn_blocks_match_onnxruntime_and_eager() -> None:
    torch.manual_seed(0)
    model = _Blocks().eval()
    model.stem[1].running_mean.uniform_(-0.5, 0.5)
    model.stem[1].running_var.uniform_(0.5, 2.0)
    onx = _export_ts(model, (torch.randn(2, 3, 32, 32),), ["x"])
    _check_against_ort(onx, lambda b: (torch.randn(b, 3, 32, 32),), eager=model)


class _ByName(nn.Module):
    def __init__(self, m: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.m, self.names = m, names

    def forward(self, x0: torch.Tensor, x1: torch.Tensor | None = None) -> torch.Tensor:
        return self.m(**dict(zip(self.names, (x0, x1))))["last_hidden_state"]


def test_hf_roberta_matches_onnxruntime_and_exports_dynamic() -> None:
    """RoBERTa (TorchScript exporter): CumSum position ids, GatherElements, GreaterOrEqual/IsNaN in the padding
    mask, Range over the batch; then torch.export of the import with a dynamic batch."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, pad_token_id=1)
    model = _ByName(tf.RobertaModel(cfg), ["input_ids", "attention_mask"]).eval()

    def inputs(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = torch.randint(2, 100, (b, 10)), torch.ones(b, 10, dtype=torch.int64)
        mask[-1, 5:] = 0
        return ids, mask

    onx = _export_ts(model, inputs(2), ["input_ids", "attention_mask"])
    _check_against_ort(onx, inputs, eager=model)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(import_onnx(onx), inputs(2), dynamic_shapes=(({0: batch}, {0: batch}),))
    xs = inputs(4)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*xs), model(*xs), atol=1e-5, rtol=1e-4)


def test_hf_mobilenetv2_tf_padding_matches_onnxruntime() -> None:
    """MobileNetV2 (TorchScript exporter): its TF-style 'same' padding reverses the pads with a step -1 Slice."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_channels=3)
    model = _ByName(tf.MobileNetV2Model(cfg), ["pixel_values"]).eval()
    onx = _export_ts(model, (torch.randn(2, 3, 32, 32),), ["pixel_values"])
    _check_against_ort(onx, lambda b: (torch.randn(b, 3, 32, 32),), eager=model)


class _Rnn(nn.Module):
    def __init__(self, kind: str, bidirectional: bool, batch_first: bool) -> None:
        super().__init__()
        if kind.startswith("rnn"):  # rnn_tanh / rnn_relu
            self.rnn = nn.RNN(16, 24, num_layers=2, nonlinearity=kind[4:], bidirectional=bidirectional,
                              batch_first=batch_first)
        else:
            cls = nn.LSTM if kind == "lstm" else nn.GRU
            self.rnn = cls(16, 24, num_layers=2, bidirectional=bidirectional, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("bidirectional, batch_first", [(False, False), (True, True)])
def test_lstm_and_gru_match_onnxruntime_and_eager(kind: str, bidirectional: bool, batch_first: bool) -> None:
    """nn.LSTM / nn.GRU / nn.RNN (2 layers) through the TorchScript exporter: ONNX LSTM / GRU / RNN nodes, imported
    as torch's fused lstm / gru / rnn_tanh / rnn_relu (gates reordered), equal to ONNX Runtime and eager within 1e-5 at batch 1 and 3 and at sequence
    lengths 5 and 9 (exported at 7); and under torch.export with the batch dynamic (torch.export fixes the sequence
    length of torch's own nn.LSTM too, on CPU). They were refused."""
    torch.manual_seed(0)
    model = _Rnn(kind, bidirectional, batch_first).eval()

    def shape(b: int, t: int) -> tuple[int, int, int]:
        return (b, t, 16) if batch_first else (t, b, 16)

    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(*shape(2, 7)),), buf, dynamo=False, input_names=["x"], opset_version=17,
                          dynamic_axes={"x": {0: "d0", 1: "d1"}})
    onx = buf.getvalue()
    assert kind.split("_")[0].upper() in {n.op_type for n in onnx.load_from_string(onx).graph.node}
    mod = import_onnx(onx)
    sess = ort.InferenceSession(onx, providers=["CPUExecutionProvider"])
    for b, t in ((1, 5), (3, 9)):
        x = torch.randn(*shape(b, t))
        with torch.no_grad():
            got, want = mod(x), model(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got, torch.from_numpy(sess.run(None, {"x": x.numpy()})[0]), atol=1e-5, rtol=1e-4)
    batch = torch.export.Dim("batch", min=1, max=32)
    ep = torch.export.export(mod, (torch.randn(*shape(2, 7)),), dynamic_shapes=(({0 if batch_first else 1: batch},),))
    x = torch.randn(*shape(3, 7))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model(x), atol=1e-5, rtol=1e-4)


def _lstm_node_model(**attrs) -> tuple[bytes, dict[str, np.ndarray]]:
    """One ONNX LSTM node (hidden 6, input 4) with initial states and all three outputs, by attributes."""
    rng = np.random.default_rng(0)
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    h = 6
    w = {"W": (rng.standard_normal((dirs, 4 * h, 4)) * 0.5).astype(np.float32),
         "R": (rng.standard_normal((dirs, 4 * h, h)) * 0.5).astype(np.float32),
         "B": (rng.standard_normal((dirs, 8 * h)) * 0.1).astype(np.float32)}
    batch_first = attrs.get("layout", 0) == 1
    x_shape, s_shape = (["b", "t", 4], ["b", dirs, h]) if batch_first else (["t", "b", 4], [dirs, "b", h])
    node = helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["y", "yh", "yc"], hidden_size=h, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                                        helper.make_tensor_value_info("h0", TensorProto.FLOAT, s_shape),
                                        helper.make_tensor_value_info("c0", TensorProto.FLOAT, s_shape)],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "yh", "yc")],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]).SerializeToString(), w


@pytest.mark.parametrize("attrs", [{"direction": "reverse"}, {"direction": "bidirectional", "layout": 1},
                                   {"layout": 1}])
def test_lstm_node_directions_and_layouts_match_onnxruntime(attrs: dict) -> None:
    """What PyTorch's exporters do not write but an ONNX file may hold: a reverse LSTM, layout 1 (batch first, with
    batch-first initial states), bidirectional; Y, Y_h and Y_c all equal to ONNX Runtime within 1e-5 (layout 1,
    which ONNX Runtime's CPU LSTM refuses: the same weights in layout 0 on the transposed inputs, outputs
    transposed back)."""
    onx, _ = _lstm_node_model(**attrs)
    mod = import_onnx(onx)
    batch_first = attrs.get("layout") == 1
    ref = _lstm_node_model(**{**attrs, "layout": 0})[0] if batch_first else onx  # same seed: same weights
    sess = ort.InferenceSession(ref, providers=["CPUExecutionProvider"])
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    rng = np.random.default_rng(1)
    b, t = 3, 5
    x = rng.standard_normal((t, b, 4)).astype(np.float32)
    h0, c0 = rng.standard_normal((dirs, b, 6)).astype(np.float32), rng.standard_normal((dirs, b, 6)).astype(np.float32)
    want = [torch.from_numpy(w) for w in sess.run(None, {"x": x, "h0": h0, "c0": c0})]
    ins = (x, h0, c0)
    if batch_first:
        ins = (x.transpose(1, 0, 2), h0.transpose(1, 0, 2), c0.transpose(1, 0, 2))
        want = [want[0].permute(2, 0, 1, 3), want[1].transpose(0, 1), want[2].transpose(0, 1)]
    with torch.no_grad():
        got = mod(*(torch.from_numpy(np.ascontiguousarray(v)) for v in ins))
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, atol=1e-5, rtol=1e-4)


def test_lstm_with_what_torch_cannot_compute_names_it() -> None:
    onx, _ = _lstm_node_model(clip=3.0)
    with pytest.raises(UsageError, match=r"LSTM with clip has no torch.lstm form.*onnxruntime backend"):
        import_onnx(onx)(torch.randn(5, 2, 4), torch.zeros(1, 2, 6), torch.zeros(1, 2, 6))


def test_lstm_sequence_lengths_are_checked_or_refused() -> None:
    """sequence_lens as an initializer (any batch size, 100 rows here) equal to the sequence length runs; shorter rows
    are named and refused; lengths given at run time are refused (rows could stop early, which torch.lstm cannot
    do), instead of silently running every row to the end."""
    onx, w = _lstm_node_model()
    m = onnx.load_from_string(onx)
    m.graph.node[0].input[4] = "lens"
    for lens, ok in ((np.full(100, 5, np.int32), True), (np.array([5] * 99 + [3], np.int32), False)):
        mm = onnx.ModelProto()
        mm.CopyFrom(m)
        mm.graph.initializer.append(numpy_helper.from_array(lens, "lens"))
        mod = import_onnx(mm.SerializeToString())
        args = (torch.randn(5, 100, 4), torch.zeros(1, 100, 6), torch.zeros(1, 100, 6))
        if ok:
            assert mod(*args)[0].shape == (5, 1, 100, 6)
        else:
            with pytest.raises(UsageError, match=r"per-row sequence_lens \[5, 5, .*3\]"):
                mod(*args)
    m.graph.input.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["b"]))
    mod = import_onnx(m.SerializeToString())
    with pytest.raises(UsageError, match="sequence_lens computed at run time"):
        mod(torch.randn(5, 2, 4), torch.zeros(1, 2, 6), torch.zeros(1, 2, 6), torch.full((2,), 5, dtype=torch.int32))
