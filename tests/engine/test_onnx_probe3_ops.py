"""Operator forms of older opsets and of current exporters, each checked against ONNX Runtime (the reference) on
one-node graphs: Pad in every mode (reflect, edge, wrap) with pads as attributes (opsets 2-10), as inputs (11+) and
for chosen axes (18); Upsample (opsets 7 and 9) and Resize-10 with their asymmetric coordinates and rounding; Slice
and TopK with their attributes (opsets 1-9); TopK's lowest-index-first order among equal values; integer
reductions that keep their type; Clip with one-element bounds; CastLike. Then a CNN with reflection and
replication padding and upsampling, exported by ``torch.onnx.export`` at opsets 9 and 17, at two batches and under
``torch.export`` with the batch dynamic."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ._onnx_nodes import ELEM, TOL  # noqa: E402
from ._onnx_nodes import check as _check  # noqa: E402
from ._onnx_nodes import one_node as _one_node  # noqa: E402


def _f(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _i(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


CASES: dict[str, tuple] = {}
_x = _f(0, 1, 2, 4, 5)
for _mode, _opset in (("constant", 11), ("reflect", 11), ("edge", 11), ("wrap", 19)):
    CASES[f"pad_{_mode}_inputs"] = ("Pad", [("x", _x), ("c", _i(0, 0, 1, 2, 0, 0, 2, 1))], {"mode": _mode}, _opset)
    CASES[f"pad_{_mode}_cropping"] = ("Pad", [("x", _x), ("c", _i(0, 0, -1, 2, 0, 0, 2, -2))], {"mode": _mode}, _opset)
    CASES[f"pad_{_mode}_axes18"] = ("Pad", [("x", _x), ("c", _i(1, 3, 2, 1)), ("", None), ("c_axes", _i(-2, 3))],
                                    {"mode": _mode}, max(_opset, 18))
for _mode in ("constant", "reflect", "edge"):  # opsets 2-10: pads and value are attributes
    CASES[f"pad_{_mode}_attributes_opset9"] = ("Pad", [("x", _x)], {"mode": _mode, "pads": [0, 0, 1, 2, 0, 0, 2, 1],
                                                                     **({"value": 1.5} if _mode == "constant" else {})}, 9)
CASES["pad_int64_value"] = ("Pad", [("x", np.arange(12).reshape(3, 4)), ("c", _i(1, 0, 0, 2)), ("c_v", _i(7))], {}, 13)

# Upsample (7: scales attribute; 9: input) and Resize-10: asymmetric; nearest floors up-scaled axes, ceils down-scaled
_SCALES = {"up": [1, 1, 2, 3], "mixed": [1, 1, 1.5, 0.75], "odd": [1, 1, 3, 0.34]}
for _tag, _sc in _SCALES.items():
    for _mode in ("nearest", "linear"):
        CASES[f"resize10_{_mode}_{_tag}"] = ("Resize", [("x", _x), ("c", np.array(_sc, np.float32))], {"mode": _mode}, 10)
        if min(_sc) >= 1:  # Upsample takes scales >= 1 only
            CASES[f"upsample9_{_mode}_{_tag}"] = ("Upsample", [("x", _x), ("c", np.array(_sc, np.float32))],
                                                  {"mode": _mode}, 9)
            CASES[f"upsample7_{_mode}_{_tag}"] = ("Upsample", [("x", _x)], {"mode": _mode, "scales": [float(v) for v in _sc]}, 7)
CASES["upsample9_nearest_3d"] = ("Upsample", [("x", _f(1, 1, 2, 3, 4, 2)), ("c", np.array([1, 1, 2, 1, 3], np.float32))],
                                 {"mode": "nearest"}, 9)
CASES["slice_attributes_opset9"] = ("Slice", [("x", _x)], {"starts": [1, -3], "ends": [2**62, -1], "axes": [2, -1]}, 9)
CASES["slice_attributes_no_axes_opset9"] = ("Slice", [("x", _x)], {"starts": [0, 1], "ends": [1, 2]}, 9)
_xi = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
for _op in ("ReduceSum", "ReduceProd", "ReduceL1", "ReduceSumSquare"):  # int32 in, int32 out
    CASES[f"{_op.lower()}_int32"] = (_op, [("x", _xi), ("c", _i(1))], {}, 18)
CASES["clip_int64_one_element_bounds"] = ("Clip", [("x", _i(-5, 1, 9)), ("c_lo", _i(0)), ("c_hi", _i(6))], {}, 13)
CASES["clip_float_one_element_bounds"] = ("Clip", [("x", _f(2, 9)), ("c_lo", np.array([-0.1], np.float32)),
                                                   ("c_hi", np.array([0.2], np.float32))], {}, 13)
CASES["clip_run_time_bounds"] = ("Clip", [("x", _f(3, 9)), ("lo", np.array(-0.1, np.float32)),
                                          ("hi", np.array(0.2, np.float32))], {}, 13)
CASES["castlike_to_int64"] = ("CastLike", [("x", np.array([-3.7, 0.5, 2.5], np.float32)), ("y", _i(1))], {}, 15)
CASES["castlike_constant_target"] = ("CastLike", [("x", _i(1, 2)), ("c_y", np.array(1.0, np.float32))], {}, 15)


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(case: str) -> None:
    op, inputs, attrs, opset = CASES[case]
    _check(*_one_node(op, inputs, attrs, opset))


def _topk_model(x: np.ndarray, k: int, attrs: dict, opset: int) -> bytes:
    ins = ["x", "k"] if opset >= 10 else ["x"]
    node = helper.make_node("TopK", ins, ["v", "i"], **attrs)
    inits = [numpy_helper.from_array(_i(k), "k")] if opset >= 10 else []
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", ELEM[x.dtype], list(x.shape))],
                          [helper.make_empty_tensor_value_info("v"), helper.make_empty_tensor_value_info("i")], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


@pytest.mark.parametrize("opset_largest", [(9, 1), (11, 1), (11, 0)])
def test_topk_orders_equal_values_lowest_index_first(opset_largest: tuple[int, int]) -> None:
    """Equal values (dequantized int8 scores tie often) come lowest index first, as the spec and ONNX Runtime
    order them, also where a run of ties straddles K; opset 9 takes K as an attribute (and has no ``largest``)."""
    opset, largest = opset_largest
    x = np.array([[0, 0, 5, 5, 1, 5], [3, 1, 3, 2, 1, 3], [2, 2, 2, 2, 2, 2]], np.float32)
    x = np.concatenate([x, np.repeat(x, 40, axis=1)], axis=1)  # long rows: where torch.topk's tie order wanders
    model = _topk_model(x, 5, {"k": 5} if opset < 10 else {"largest": largest}, opset)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    out = import_onnx(model)(torch.from_numpy(x))
    for o, r in zip(out, ref):
        assert o.numpy().dtype == r.dtype
        np.testing.assert_array_equal(o.numpy(), r)


class _PaddedCNN(nn.Module):
    """Reflection padding (style transfer, pix2pix), replication padding, and an upsampling head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.reflect = nn.ReflectionPad2d((1, 2, 2, 1))
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.replicate = nn.ReplicationPad2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.reflect(F.relu(self.conv1(x))))  # (B, 8, H + 1, W + 1)
        y = F.interpolate(y, scale_factor=2, mode="nearest") + F.interpolate(y, scale_factor=2, mode="bilinear")
        return self.replicate(y)[:, :, 1:-1]


@pytest.mark.parametrize("opset", [9, 17])
def test_exported_padded_cnn_matches_onnxruntime_and_exports_dynamic(opset: int) -> None:
    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_PaddedCNN().eval(), (torch.randn(2, 3, 8, 6),), buf, input_names=["x"],
                          dynamic_axes={"x": {0: "b"}}, opset_version=opset, dynamo=False)
    ops = {n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node}
    assert "Pad" in ops and ("Upsample" in ops if opset == 9 else "Resize" in ops), ops
    mod, sess = import_onnx(buf.getvalue()), ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(mod, (torch.randn(2, 3, 8, 6),), dynamic_shapes=(({0: batch},),))
    for b in (1, 3):
        x = torch.randn(b, 3, 8, 6)
        ref = sess.run(None, {"x": x.numpy()})[0]
        for run in (mod, ep.module()):
            np.testing.assert_allclose(run(x).detach().numpy(), ref, rtol=1e-4, atol=1e-4)
