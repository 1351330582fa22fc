"""Operators of TF/Keras-exported CNNs, super-resolution models, detection heads and LLM exports, each checked
against ONNX Runtime (the reference) on one-node graphs built with onnx.helper at the opsets that define them, at
two input shapes: DepthToSpace (DCR, CRD) and SpaceToDepth, ScatterND and ScatterElements with each reduction,
OneHot, Size, NonZero of a constant, LRN (odd and even window), Resize nearest in every coordinate mode and
rounding (the ONNX default half_pixel + round_prefer_floor included), Celu, Softsign, ThresholdedRelu. NonZero of
a run-time tensor is refused with one line naming the node. Then a torch-exported super-resolution model and a
tf2onnx-style upsampling graph, at two batches and under torch.export with the batch dynamic."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import SUPPORTED_OPS, import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ._onnx_nodes import TOL  # noqa: E402
from ._onnx_nodes import check as _check  # noqa: E402
from ._onnx_nodes import one_node as _one_node  # noqa: E402



def _f(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


SHAPES = [(1, 8, 3, 5), (2, 12, 4, 2)]  # (N, C, H, W): C divisible by 4 (blocksize 2)
CASES: dict[str, tuple] = {}
for _k, (_n, _c, _h, _w) in enumerate(SHAPES):
    _x = _f(_k, _n, _c, _h, _w)
    for _mode in ("DCR", "CRD"):
        CASES[f"depth_to_space_{_mode}_{_k}"] = ("DepthToSpace", [("x", _x)], {"blocksize": 2, "mode": _mode}, 13)
    CASES[f"depth_to_space_default_opset11_{_k}"] = ("DepthToSpace", [("x", _x)], {"blocksize": 2}, 11)
    CASES[f"space_to_depth_{_k}"] = ("SpaceToDepth", [("x", _f(_k, _n, _c, 2 * _h, 4 * _w))], {"blocksize": 2}, 13)
    for _size in (5, 3):  # AlexNet, GoogLeNet (ONNX Runtime accepts odd windows only)
        CASES[f"lrn_size{_size}_{_k}"] = ("LRN", [("x", _x)], {"size": _size, "alpha": 1e-2, "beta": 0.75, "bias": 2.0}, 13)
    for _red in ("none", "add", "mul", "max", "min"):
        # duplicate indices (a reduction's point) only where the result is defined: not for "none"
        _i = np.array([[1, 0, 2]] * _n, np.int64) if _red == "none" else np.array([[1, -2, 1, 2]] * _n, np.int64)
        _idx = np.broadcast_to(_i[:, :, None, None], (_n, _i.shape[1], _h, _w)).copy()
        CASES[f"scatter_elements_{_red}_{_k}"] = (
            "ScatterElements", [("x", _x), ("i", _idx), ("u", _f(_k + 9, *_idx.shape))], {"axis": 1, "reduction": _red}, 18)
        # ScatterND: whole rows (k = 2 of 4 dims) and single elements (k = 4), a negative index included
        _rows = np.array([[0, 1], [_n - 1, -1], [0, 3]], np.int64) if _red == "none" else \
            np.array([[0, 1], [_n - 1, -1], [0, 1]], np.int64)
        CASES[f"scatter_nd_rows_{_red}_{_k}"] = (
            "ScatterND", [("x", _x), ("i", _rows), ("u", _f(_k + 3, 3, _h, _w))], {"reduction": _red}, 18)
        _elem = np.array([[[0, 2, 1, 0], [_n - 1, 0, _h - 1, _w - 1]]], np.int64)
        CASES[f"scatter_nd_elements_{_red}_{_k}"] = (
            "ScatterND", [("x", _x), ("i", _elem), ("u", _f(_k + 4, 1, 2))], {"reduction": _red}, 18)
CASES["scatter_elements_opset11"] = ("ScatterElements", [("x", _f(5, 3, 4)), ("i", np.array([[3, 0], [1, 2], [0, -1]])),
                                                         ("u", _f(6, 3, 2))], {"axis": 1}, 11)
CASES["scatter_nd_opset11_detection_boxes"] = ("ScatterND", [("x", _f(7, 10, 4)), ("c", np.array([[2], [7]], np.int64)),
                                                             ("u", _f(8, 2, 4))], {}, 11)
for _axis in (-1, 0, 1):
    CASES[f"one_hot_axis{_axis}"] = ("OneHot", [("i", np.array([[0, 3, -1], [9, 2, 5]], np.int64)),
                                                ("c_depth", np.array(5, np.int64)),
                                                ("c_vals", np.array([-1.0, 2.5], np.float32))], {"axis": _axis}, 11)
CASES["one_hot_int64_values"] = ("OneHot", [("i", np.array([1, 0, 4], np.int64)), ("c_depth", np.array([4], np.int64)),
                                            ("c_vals", np.array([0, 1], np.int64))], {}, 11)
CASES["one_hot_float_indices_and_depth"] = ("OneHot", [("i", np.array([1.0, 0.0, 3.0], np.float32)),
                                                       ("c_depth", np.array([4.0], np.float32)),
                                                       ("c_vals", np.array([0.0, 1.0], np.float32))], {}, 11)
CASES["celu"] = ("Celu", [("x", _f(1, 3, 7))], {"alpha": 0.7}, 12)
CASES["softsign"] = ("Softsign", [("x", _f(2, 3, 7))], {}, 13)
CASES["thresholded_relu"] = ("ThresholdedRelu", [("x", _f(3, 3, 7))], {"alpha": 0.3}, 10)

# Resize nearest: every coordinate mode and rounding over up- and down-scales, by scales and by sizes
_RESIZE = [("half_pixel", "round_prefer_floor"), ("asymmetric", "round_prefer_floor"), ("align_corners", "floor"),
           ("tf_half_pixel_for_nn", "round_prefer_ceil"), ("asymmetric", "ceil"), ("half_pixel", "floor"),
           ("pytorch_half_pixel", "round_prefer_floor"), ("align_corners", "round_prefer_ceil")]
for _ctm, _near in _RESIZE:
    _x = _f(11, 1, 2, 5, 6)
    for _tag, _sc in (("up", [1, 1, 2.0, 1.5]), ("down", [1, 1, 0.5, 0.34]), ("tie", [1, 1, 0.4, 2.0 / 3.0])):
        CASES[f"resize_nearest_{_ctm}_{_near}_{_tag}"] = (
            "Resize", [("x", _x), ("", None), ("c", np.array(_sc, np.float32))],
            {"mode": "nearest", "coordinate_transformation_mode": _ctm, "nearest_mode": _near}, 13)
    CASES[f"resize_nearest_{_ctm}_{_near}_sizes"] = (
        "Resize", [("x", _f(12, 2, 1, 4, 7)), ("", None), ("", None), ("c", np.array([2, 1, 9, 3], np.int64))],
        {"mode": "nearest", "coordinate_transformation_mode": _ctm, "nearest_mode": _near}, 13)
CASES["resize_nearest_onnx_defaults_opset19_half_pixel_symmetric"] = (
    "Resize", [("x", _f(13, 1, 1, 5, 5)), ("", None), ("c", np.array([1, 1, 1.7, 0.6], np.float32))],
    {"coordinate_transformation_mode": "half_pixel_symmetric"}, 19)
CASES["resize_nearest_onnx_defaults"] = (
    "Resize", [("x", _f(14, 1, 3, 6, 4)), ("", None), ("c", np.array([1, 1, 0.5, 2.5], np.float32))], {}, 18)


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(case: str) -> None:
    op, inputs, attrs, *opset = CASES[case]
    _check(*_one_node(op, inputs, attrs, *opset))


def test_size_and_nonzero_of_a_constant_fold_into_the_graph() -> None:
    """Size of a graph input (an int64 scalar); NonZero of an initializer, feeding a Gather: folded at build time."""
    mask = np.array([[0, 1, 0], [1, 1, 0]], np.bool_)
    nodes = [helper.make_node("Size", ["x"], ["n"]), helper.make_node("NonZero", ["c_mask"], ["nz"]),
             helper.make_node("Cast", ["nz"], ["nzf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["nzf", "x0"], ["y"]), helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["y", "nf"], ["out"]),
             helper.make_node("ReduceSum", ["x"], ["x0"], keepdims=0)]
    nodes = nodes[-1:] + nodes[:-1]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(mask, "c_mask")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    _check(model, {"x": _f(20, 2, 5)})


def test_nonzero_of_a_runtime_tensor_is_refused_naming_the_node() -> None:
    model, feeds = _one_node("NonZero", [("x", _f(21, 3, 4))], {}, 13)
    with pytest.raises(UsageError, match=r"ONNX node 'the_node' \(NonZero\): NonZero of a tensor computed at run "
                                         r"time has a data-dependent output shape"):
        import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))


@pytest.mark.parametrize("op", ["NonMaxSuppression", "MaxRoiPool", "MaxUnpool", "Col2Im", "DFT"])
def test_unsupported_ops_still_fail_at_build_naming_op_and_node(op: str) -> None:
    assert op not in SUPPORTED_OPS
    node = helper.make_node(op, ["x"], ["out"], name="n7")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    with pytest.raises(UsageError, match=rf"ONNX operator {op} \(node 'n7'\) is not supported"):
        import_onnx(helper.make_model(g))


class _SuperRes(nn.Module):
    """ESPCN-like: a conv and nn.PixelShuffle (DepthToSpace CRD), an in-place row write (ScatterND), a label
    one-hot (OneHot), a nearest downscale; two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.shuffle(self.conv(x))  # (B, 3, 2H, 2W)
        y[:, :, 0] = 0.5
        return F.interpolate(y, scale_factor=0.5, mode="nearest"), F.one_hot(labels, 5).float()


def test_exported_super_resolution_model_matches_onnxruntime_and_exports_dynamic() -> None:
    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_SuperRes().eval(), (torch.randn(2, 3, 8, 6), torch.tensor([1, 4])), buf,
                          input_names=["x", "labels"], dynamic_axes={"x": {0: "b"}, "labels": {0: "b"}},
                          opset_version=17, dynamo=False)
    ops = {n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node}
    assert {"DepthToSpace", "ScatterND", "OneHot"} <= ops, ops
    mod, sess = import_onnx(buf.getvalue()), ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(mod, (torch.randn(2, 3, 8, 6), torch.tensor([1, 4])), dynamic_shapes=(({0: batch}, {0: batch}),))
    for b in (1, 3):
        x, labels = torch.randn(b, 3, 8, 6), torch.tensor([4, 0, 2][:b])
        ref = sess.run(None, {"x": x.numpy(), "labels": labels.numpy()})
        for run in (mod, ep.module()):
            for out, r in zip(run(x, labels), ref):
                np.testing.assert_allclose(out.detach().numpy(), r, rtol=TOL, atol=TOL)


def test_tf_style_graph_with_dynamic_batch_exports() -> None:
    """What tf2onnx writes for a Keras upsampling head: DepthToSpace (DCR) then Resize nearest with the ONNX defaults
    (half_pixel, round_prefer_floor), over a batch named "N"; checked at two batches and under torch.export."""
    nodes = [helper.make_node("DepthToSpace", ["x"], ["d"], blocksize=2),
             helper.make_node("Resize", ["d", "", "c_scales"], ["out"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 3, 5])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.array([1, 1, 1.5, 0.5], np.float32), "c_scales")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()
    for b in (1, 3):
        _check(model, {"x": _f(30 + b, b, 8, 3, 5)})
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(import_onnx(model), (torch.randn(2, 8, 3, 5),), dynamic_shapes=(({0: batch},),))
    x = _f(40, 4, 8, 3, 5)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ep.module()(torch.from_numpy(x)).numpy(), ref, rtol=TOL, atol=TOL)
