"""ONNX files users export, checked op by op against ONNX Runtime (the reference): Pow keeps an integer base's
type, Clip without bounds, pytorch_half_pixel Resize to one pixel, the norm-like reductions and Einsum (what
``torch.linalg.vector_norm``, ``logsumexp`` and ``torch.einsum`` export to), an operator's refusal naming its node,
and a torch-exported model with Einsum and ReduceL2 at opsets 13, 17, 18 and batch sizes inside a dynamic axis."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from ._onnx_nodes import TOL  # noqa: E402
from ._onnx_nodes import check as _check  # noqa: E402
from ._onnx_nodes import one_node as _one_node  # noqa: E402

_R = np.random.default_rng(0)


def _f(*shape: int) -> np.ndarray:
    return _R.standard_normal(shape).astype(np.float32)


_BASE = np.array([1, 2, 3, 4, 10], np.int64)
CASES = {
    # ONNX Pow's output has the base's type: int64 ** float truncates back to int64 (torch.pow gave float32)
    "pow_int_base_float_exponent": ("Pow", [("x", _BASE), ("e", np.array([0.5, 1.5, 2.0, 0.3, 2.5], np.float32))], {}),
    "pow_int_base_float_scalar": ("Pow", [("x", _BASE), ("c", np.array(0.5, np.float32))], {}),
    "pow_host_int_base_float_tensor": ("Pow", [("c", np.array([3], np.int64)), ("e", np.array([0.5, 2.2], np.float32))], {}),
    "pow_float_base_int_exponent": ("Pow", [("x", _f(5)), ("c", np.array(3, np.int64))], {}),
    # Clip's bounds are both optional: none clips nothing (torch.clamp raised)
    "clip_without_bounds": ("Clip", [("x", _f(6))], {}),
    "clip_max_only": ("Clip", [("x", _f(6)), ("", None), ("c", np.array(0.1, np.float32))], {}),
    # pytorch_half_pixel maps an output axis of length 1 to input coordinate 0, not the centre
    "resize_php_linear_sizes_to_1": ("Resize", [("x", _f(1, 2, 5, 6)), ("", None), ("", None),
                                                ("c", np.array([1, 2, 1, 3], np.int64))],
                                     {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "resize_php_linear_scales_to_1": ("Resize", [("x", _f(1, 2, 5, 6)), ("", None),
                                                 ("c", np.array([1, 1, 0.2, 0.5], np.float32))],
                                      {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "resize_php_cubic_sizes_1x1": ("Resize", [("x", _f(2, 3, 4, 4)), ("", None), ("", None),
                                              ("c", np.array([2, 3, 1, 1], np.int64))],
                                   {"mode": "cubic", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "einsum_batched_matmul": ("Einsum", [("x", _f(2, 3, 4)), ("y", _f(2, 5, 4))], {"equation": "bij,bkj->bik"}),
    "einsum_ellipsis": ("Einsum", [("x", _f(2, 3, 4)), ("c", _f(4, 5))], {"equation": "...j, jk -> ...k"}),
    "einsum_diagonal": ("Einsum", [("x", _f(3, 3))], {"equation": "ii->i"}),
    "einsum_implicit_output": ("Einsum", [("x", _f(3, 4)), ("y", _f(4, 2))], {"equation": "ij,jk"}),
}
for _op in ("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp", "ReduceProd"):
    _x = np.abs(_f(2, 3, 4)) + 0.1
    CASES[f"{_op}_axes_input_18"] = (_op, [("x", _x), ("c", np.array([-1, 0], np.int64))], {"keepdims": 0})
    CASES[f"{_op}_axes_attribute_13"] = (_op, [("x", _x)], {"axes": [1], "keepdims": 1}, 13)
    CASES[f"{_op}_all_axes"] = (_op, [("x", _x)], {"keepdims": 0})


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(case: str) -> None:
    op, inputs, attrs, *opset = CASES[case]
    _check(*_one_node(op, inputs, attrs, *opset))


def test_reduce_logsumexp_large_logits_stay_finite() -> None:
    x = np.array([[1000.0, 1000.0, -5.0]], np.float32)
    _check(*_one_node("ReduceLogSumExp", [("x", x), ("c", np.array([1], np.int64))], {"keepdims": 1}))


def test_operator_refusal_names_the_node() -> None:
    """An operator that refuses its attributes (here Resize's asymmetric cubic) names the node and the op,
    so the user can find it in a graph of thousands."""
    model, feeds = _one_node("Resize", [("x", _f(1, 2, 4, 4)), ("", None), ("c", np.array([1, 1, 2, 2], np.float32))],
                             {"mode": "cubic", "coordinate_transformation_mode": "asymmetric"})
    with pytest.raises(UsageError, match=r"ONNX node 'the_node' \(Resize\): Resize cubic with "
                                         r"coordinate_transformation_mode='asymmetric' is not supported.*supported "
                                         r"for cubic: half_pixel"):
        import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))


class _Attention(nn.Module):
    """Einsum attention scores, a vector norm (ReduceL2), an int ** float Pow and a bound-less clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 8)
        h = self.proj(x)
        att = torch.einsum("btd,bsd->bts", h, x).softmax(-1)  # (B, T, T)
        y = torch.einsum("bts,bsd->btd", att, h)  # (B, T, 8)
        return y / torch.linalg.vector_norm(y, 2, -1, keepdim=True).clamp(min=1e-6)


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_exported_einsum_model_matches_onnxruntime_across_batches(opset: int) -> None:
    torch.manual_seed(0)
    model = _Attention().eval()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 5, 8),), buf, input_names=["x"], dynamic_axes={"x": {0: "batch"}},
                          opset_version=opset, dynamo=False)
    ops = {n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node}
    assert {"Einsum", "ReduceL2"} <= ops, ops
    mod = import_onnx(buf.getvalue())
    sess = ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"])
    for batch in (1, 3, 7):
        x = torch.randn(batch, 5, 8)
        ref = sess.run(None, {"x": x.numpy()})[0]
        np.testing.assert_allclose(mod(x).detach().numpy(), ref, rtol=TOL, atol=TOL)
