"""The importer's selection ops (TopK, ArgMax, ArgMin; ``engine/onnx/select.py``): each against ONNX Runtime on
a one-node graph (values to 1e-6, indices exact), and a detection head (sigmoid scores -> TopK -> gather of the
boxes) from both exporters against eager fp32, also traced by torch.export with a dynamic batch."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

_X = np.random.default_rng(0).standard_normal((3, 7, 5)).astype(np.float32)
_TIES = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, -1.0]], np.float32)


def _graph(op: str, x: np.ndarray, attrs: dict, outputs: int, k: int | None = None, opset: int = 18) -> bytes:
    inits = [numpy_helper.from_array(np.array([k], np.int64), "k")] if k is not None else []
    node = helper.make_node(op, ["x", "k"] if k is not None else ["x"], [f"y{i}" for i in range(outputs)], **attrs)
    types = [TensorProto.FLOAT, TensorProto.INT64] if op == "TopK" else [TensorProto.INT64]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                          [helper.make_tensor_value_info(f"y{i}", types[i], None) for i in range(outputs)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


CASES = {
    "topk_last_axis_largest": ("TopK", _X, {}, 2, 3),
    "topk_axis1_smallest": ("TopK", _X, {"axis": 1, "largest": 0}, 2, 4),
    "topk_k_is_the_whole_axis": ("TopK", _X, {"axis": 0}, 2, 3),
    "argmax_axis1": ("ArgMax", _X, {"axis": 1}, 1, None),
    "argmax_no_keepdims_negative_axis": ("ArgMax", _X, {"axis": -1, "keepdims": 0}, 1, None),
    "argmin_axis0": ("ArgMin", _X, {}, 1, None),
    "argmax_ties_first": ("ArgMax", _TIES, {"axis": 1}, 1, None),
    "argmax_ties_last": ("ArgMax", _TIES, {"axis": 1, "select_last_index": 1}, 1, None),
    "argmin_ties_last": ("ArgMin", _TIES, {"axis": 1, "select_last_index": 1, "keepdims": 0}, 1, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(case: str) -> None:
    op, x, attrs, outputs, k = CASES[case]
    model = _graph(op, x, attrs, outputs, k)
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    out = import_onnx(model)(torch.from_numpy(x))
    out = out if isinstance(out, (tuple, list)) else (out,)
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert tuple(o.shape) == r.shape and o.numpy().dtype == r.dtype
        if r.dtype.kind == "f":
            np.testing.assert_allclose(o.numpy(), r, atol=1e-6, rtol=1e-6)
        else:
            np.testing.assert_array_equal(o.numpy(), r)


class DetHead(nn.Module):
    """feat (B, 8, H, W) -> the 10 best of H*W anchors: boxes (B, 10, 4), scores (B, 10), indices (B, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.pred = nn.Conv2d(8, 5, 1)

    def forward(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.pred(feat).flatten(2).transpose(1, 2)  # (B, HW, 5): 4 box coordinates and a logit
        scores, idx = torch.sigmoid(p[..., 4]).topk(10, dim=1)
        boxes = torch.gather(p[..., :4], 1, idx.unsqueeze(-1).expand(-1, -1, 4))
        return boxes, scores, idx


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
def test_detection_head_matches_eager(dynamo: bool) -> None:
    """It failed to import ("ONNX operator TopK ... is not supported"). Tolerance: fp32, 1e-5; indices exact."""
    torch.manual_seed(0)
    head = DetHead().eval()
    feat = torch.randn(2, 8, 6, 6)
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            prog = torch.onnx.export(head, (feat,), dynamo=True, input_names=["feat"], verbose=False,
                                     dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
            model = prog.model_proto.SerializeToString()
        else:
            torch.onnx.export(head, (feat,), buf, dynamo=False, input_names=["feat"], opset_version=17,
                              dynamic_axes={"feat": {0: "b"}})
            model = buf.getvalue()
    mod = import_onnx(model)
    ep = torch.export.export(mod, (feat,), dynamic_shapes=(({0: torch.export.Dim("b", min=1, max=8)},),))
    for x in (feat, torch.randn(5, 8, 6, 6)):
        with torch.no_grad():
            ref = head(x)
            outs = ep.module()(x)
        for o, r in zip(outs, ref):
            assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(outs[0], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1], ref[1], atol=1e-5, rtol=1e-5)
        assert torch.equal(outs[2], ref[2])
