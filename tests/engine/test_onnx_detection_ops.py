"""Operators of detection, warping and sequence models, each checked against ONNX Runtime (the reference) on
one-node graphs over several attribute combinations: GridSample (opsets 16 and 20, every mode, padding and
align_corners; 5-D), RoiAlign (avg and max, both coordinate modes, opsets 10 and 16), Resize linear in the
coordinate modes F.interpolate lacks (asymmetric, half_pixel_symmetric, tf_half_pixel_for_nn), ReverseSequence,
BitShift, Shrink, Compress by a constant condition and Unique of a constant. The data-dependent forms
(NonMaxSuppression, Compress by a run-time condition, Unique of run-time data, RoiAlign's adaptive sampling) are
refused with one line naming the node."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ._onnx_nodes import check as _check  # noqa: E402
from ._onnx_nodes import one_node as _one_node  # noqa: E402


def _f(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


CASES: dict[str, tuple] = {}
# GridSample: grid points past [-1, 1] exercise the padding modes
_X, _G = _f(0, 2, 3, 6, 7), np.random.default_rng(1).uniform(-1.3, 1.3, (2, 4, 5, 2)).astype(np.float32)
for _opset, _modes in ((16, ("bilinear", "nearest", "bicubic")), (20, ("linear", "nearest", "cubic"))):
    for _mode in _modes:
        for _pad in ("zeros", "border", "reflection"):
            for _ac in (0, 1):
                CASES[f"grid_sample_{_opset}_{_mode}_{_pad}_{_ac}"] = (
                    "GridSample", [("x", _X), ("g", _G)], {"mode": _mode, "padding_mode": _pad, "align_corners": _ac},
                    _opset)
for _mode in ("linear", "nearest"):
    CASES[f"grid_sample_5d_{_mode}"] = (
        "GridSample", [("x", _f(2, 1, 2, 3, 4, 5)),
                       ("g", np.random.default_rng(3).uniform(-1.2, 1.2, (1, 2, 3, 4, 3)).astype(np.float32))],
        {"mode": _mode, "padding_mode": "border"}, 20)
# RoiAlign: boxes inside, partly outside, tiny and entirely past the image; two batch entries
_ROIS = np.array([[0, 0, 9, 9], [1.3, 2.2, 7.9, 5.1], [-3, -2, 4, 14], [5, 5, 5.2, 5.4], [10, 8, 30, 30]], np.float32)
_BATCH = np.array([0, 1, 1, 0, 1], np.int64)
for _opset, _ctms in ((10, (None,)), (16, ("half_pixel", "output_half_pixel"))):
    for _ctm in _ctms:
        for _mode in ("avg", "max"):
            for _ratio, _scale, _oh, _ow in ((2, 1.0, 3, 4), (1, 0.5, 2, 2), (3, 1.0, 1, 5)):
                _a = {"mode": _mode, "sampling_ratio": _ratio, "spatial_scale": _scale, "output_height": _oh,
                      "output_width": _ow}
                if _ctm:
                    _a["coordinate_transformation_mode"] = _ctm
                CASES[f"roi_align_{_opset}_{_ctm}_{_mode}_{_ratio}"] = (
                    "RoiAlign", [("x", _f(4, 2, 3, 10, 12)), ("r", _ROIS), ("b", _BATCH)], _a, _opset)
# Resize linear in coordinate modes F.interpolate lacks: up, down and uneven scales, by scales and by sizes
for _ctm in ("asymmetric", "half_pixel_symmetric", "tf_half_pixel_for_nn"):
    for _k, _sc in enumerate(([1, 1, 2, 2], [1, 1, 0.5, 1.7], [1, 1, 0.34, 3.0], [1, 1, 1.5])):
        CASES[f"resize_linear_{_ctm}_{_k}"] = (
            "Resize", [("x", _f(5 + _k, *(2, 3, 5, 7)[:len(_sc)])), ("", None), ("c", np.array(_sc, np.float32))],
            {"mode": "linear", "coordinate_transformation_mode": _ctm}, 19)
    CASES[f"resize_linear_{_ctm}_sizes"] = (
        "Resize", [("x", _f(9, 2, 3, 5, 7)), ("", None), ("", None), ("c", np.array([2, 3, 9, 4], np.int64))],
        {"mode": "linear", "coordinate_transformation_mode": _ctm}, 19)
# ReverseSequence: time-major and batch-major, lengths from 1 to the full length
_LENS = np.array([4, 1, 3], np.int64)
CASES["reverse_sequence_time_major"] = ("ReverseSequence", [("x", _f(10, 4, 3, 2)), ("l", _LENS)],
                                        {"time_axis": 0, "batch_axis": 1}, 10)
CASES["reverse_sequence_batch_major"] = ("ReverseSequence", [("x", _f(11, 3, 4, 2, 2)), ("l", _LENS)],
                                         {"time_axis": 1, "batch_axis": 0}, 10)
for _d in ("LEFT", "RIGHT"):
    for _t in (np.uint8, np.uint32, np.uint64):
        _v = np.array([[1, 7, 200, 255], [0, 3, 128, 64]], _t)
        if _t == np.uint64:  # the top bit set: a right shift must not copy it (int64's would)
            _v[0, 2] = np.uint64(2**64 - 3)
        CASES[f"bit_shift_{_d}_{np.dtype(_t).name}"] = (
            "BitShift", [("x", _v), ("s", np.array([0, 1, 3, 7], _t))], {"direction": _d}, 11)
for _lambd, _bias in ((0.5, 0.0), (0.3, 0.3), (1.0, -0.2)):
    CASES[f"shrink_{_lambd}_{_bias}"] = ("Shrink", [("x", _f(12, 3, 8))], {"lambd": _lambd, "bias": _bias}, 9)
_COND = np.array([True, False, True, True, False], np.bool_)
CASES["compress_axis1"] = ("Compress", [("x", _f(13, 2, 5, 3)), ("c", _COND)], {"axis": 1}, 11)
CASES["compress_negative_axis_short_condition"] = ("Compress", [("x", _f(14, 2, 6)), ("c", _COND[:3])], {"axis": -1}, 11)
CASES["compress_flattened"] = ("Compress", [("x", _f(15, 2, 3)), ("c", np.array([0, 1, 1, 0, 0, 1], np.bool_))], {}, 11)


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(case: str) -> None:
    op, inputs, attrs, opset = CASES[case]
    _check(*_one_node(op, inputs, attrs, opset))


def _unique_model(data: np.ndarray, attrs: dict) -> bytes:
    node = helper.make_node("Unique", ["c"], ["y", "idx", "inv", "cnt"], name="the_node", **attrs)
    outs = [helper.make_empty_tensor_value_info(n) for n in ("y", "idx", "inv", "cnt")]
    g = helper.make_graph([node], "g", [], outs, [numpy_helper.from_array(data, "c")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()


@pytest.mark.parametrize("attrs", [{}, {"sorted": 0}, {"axis": 0}, {"axis": 1, "sorted": 0}])
def test_unique_of_a_constant_matches_onnxruntime(attrs: dict) -> None:
    """All four outputs (values, first indices, inverse indices, counts), exactly."""
    data = np.array([[2, 1, 2, 3], [2, 1, 2, 3], [0, 5, 0, 1]], np.int64)
    model = _unique_model(data, attrs)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {})
    out = import_onnx(model)()
    for o, r in zip(out, ref):
        assert o.numpy().dtype == r.dtype
        np.testing.assert_array_equal(o.numpy(), r)


def _graph(op: str, ins: list[str], inputs: list, attrs: dict, opset: int = 11, inits: tuple = ()) -> bytes:
    node = helper.make_node(op, ins, ["out"], name="the_node", **attrs)
    g = helper.make_graph([node], "g", inputs, [helper.make_empty_tensor_value_info("out")], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def test_data_dependent_forms_are_refused_naming_the_node() -> None:
    f32 = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [5])
    with pytest.raises(UsageError, match=r"ONNX node 'the_node' \(Compress\): Compress with a condition computed at "
                                         r"run time has a data-dependent output shape.*--backend onnxruntime"):
        import_onnx(_graph("Compress", ["x", "c"], [f32, cond], {"axis": 1}))(torch.zeros(2, 5),
                                                                              torch.ones(5, dtype=torch.bool))
    with pytest.raises(UsageError, match=r"ONNX node 'the_node' \(Unique\): Unique of a tensor computed at run time"):
        import_onnx(_graph("Unique", ["x"], [f32], {}))(torch.zeros(2, 5))
    boxes = helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 4, 4])
    scores = helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 1, 4])
    with pytest.raises(UsageError, match=r"ONNX operator NonMaxSuppression \(node 'the_node'\) is not supported.*"
                                         r"depends on the scores.*export the detector without its NMS"):
        import_onnx(_graph("NonMaxSuppression", ["b", "s"], [boxes, scores], {}))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 4])
    b = helper.make_tensor_value_info("i", TensorProto.INT64, [1])
    with pytest.raises(UsageError, match=r"ONNX node 'the_node' \(RoiAlign\): RoiAlign sampling_ratio=0 .*re-export "
                                         r"with sampling_ratio > 0"):
        import_onnx(_graph("RoiAlign", ["x", "r", "i"], [x, r, b], {}, 16))(
            torch.zeros(1, 1, 4, 4), torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64))


def test_grid_sample_and_roi_align_trace_under_export() -> None:
    """The new samplers export with torch.export as one graph (no data-dependent control flow) and still match."""
    model = _graph("GridSample", ["x", "g"], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 7]),
                                              helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 4, 5, 2])],
                   {"mode": "bilinear", "padding_mode": "border"}, 16)
    ep = torch.export.export(import_onnx(model), (torch.from_numpy(_X), torch.from_numpy(_G)))
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": _X, "g": _G})[0]
    np.testing.assert_allclose(ep.module()(torch.from_numpy(_X), torch.from_numpy(_G)).numpy(), ref, atol=1e-5)
    x = _f(4, 2, 3, 10, 12)
    model = _graph("RoiAlign", ["x", "r", "b"], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 10, 12]),
                                                 helper.make_tensor_value_info("r", TensorProto.FLOAT, [5, 4]),
                                                 helper.make_tensor_value_info("b", TensorProto.INT64, [5])],
                   {"sampling_ratio": 2, "output_height": 3, "output_width": 3}, 16)
    args = (torch.from_numpy(x), torch.from_numpy(_ROIS), torch.from_numpy(_BATCH))
    ep = torch.export.export(import_onnx(model), args)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x, "r": _ROIS, "b": _BATCH})[0]
    np.testing.assert_allclose(ep.module()(*args).numpy(), ref, atol=1e-5)
