"""The ONNX ops of overdrive's importer that reduce or pick along axes: TopK (a detection head's best boxes, beam
search) and ArgMax / ArgMin (a classifier's label), as ``torch.topk`` / ``torch.argmax`` / ``torch.argmin``; the
Reduce family (ReduceMean/Sum/Max/Min, and the norm-like ReduceL1, ReduceL2, ReduceSumSquare, ReduceLogSum,
ReduceLogSumExp, ReduceProd: ``torch.linalg.vector_norm`` and ``F.normalize`` export to ReduceL2, ``logsumexp``
to ReduceLogSumExp); and Einsum, a sum over its contracted labels (``torch.einsum`` exports to it).

Reduce axes come from the second input (opset 18; ReduceSum from 13) or the ``axes`` attribute (before); no axes
reduce over all of them, unless ``noop_with_empty_axes`` is set, which leaves the elementwise part alone (|x| for
ReduceL1, x*x for ReduceSumSquare): a reduction over no axis.

Example:
    >>> sorted(k for k in OPS if not k.startswith("Reduce"))
    ['ArgMax', 'ArgMin', 'Einsum', 'TopK']
    >>> x = torch.tensor([[3.0, 4.0]])
    >>> OPS["ReduceL2"](None, [x, np.array([1])], {"keepdims": 0})[0]
    tensor([5.])
    >>> OPS["Einsum"](None, [x, x], {"equation": b"ij,kj->ik"})[0]
    tensor([[25.]])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import Op, OpModule, Value, _gemm_dtype, _ints, _tensor


def _topk(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """TopK(X, K) -> (Values, Indices int64) along ``axis`` (default -1), the largest first (``largest`` 1) or the
    smallest; ``sorted`` 0 lets the order be any, which torch's sorted order satisfies. K is read on the host
    (a constant, or a size computed from the input's shape)."""
    x = _tensor(ins[0])
    k = _ints(ins[1])[0]
    axis = int(a.get("axis", -1))
    values, idx = torch.topk(x, k, dim=axis, largest=bool(a.get("largest", 1)), sorted=True)
    return [values, idx]


def _arg(largest: bool) -> Op:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        axis, keep = int(a.get("axis", 0)) % x.dim(), bool(a.get("keepdims", 1))
        if a.get("select_last_index", 0):  # the last of equal values: the first one of the flipped axis
            flipped = (torch.argmax if largest else torch.argmin)(x.flip(axis), dim=axis, keepdim=keep)
            return [x.shape[axis] - 1 - flipped]
        return [(torch.argmax if largest else torch.argmin)(x, dim=axis, keepdim=keep)]
    return run


def _reduce_axes(x: torch.Tensor, ins: list[Value], a: dict) -> list[int] | None:
    """The axes to reduce, positive and sorted; [] for a no-op reduction, None for all axes."""
    if len(ins) > 1 and ins[1] is not None:
        axes = _ints(ins[1])
    else:
        axes = list(a.get("axes", []))
    if not axes:
        return [] if a.get("noop_with_empty_axes", 0) else None
    return sorted({ax % x.dim() for ax in axes})


def _norm_reduce(elementwise: Callable[[torch.Tensor], torch.Tensor], after: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Op:
    """A reduction as ``after(sum(elementwise(x)))`` over the axes (ReduceL2: sqrt of the sum of squares)."""
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        axes, keep = _reduce_axes(x, ins, a), bool(a.get("keepdims", 1))
        if axes == []:
            return [after(elementwise(x))]
        return [after(elementwise(x).sum(dim=axes if axes is not None else None, keepdim=keep))]
    return run


def _log_sum_exp(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    axes, keep = _reduce_axes(x, ins, a), bool(a.get("keepdims", 1))
    if axes == []:
        return [x]
    # torch.logsumexp subtracts the max first, so large logits do not overflow to inf
    return [torch.logsumexp(x, dim=axes if axes is not None else list(range(x.dim())), keepdim=keep)]


def _prod(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    axes, keep = _reduce_axes(x, ins, a), bool(a.get("keepdims", 1))
    if axes is None:
        axes = list(range(x.dim()))
    for ax in reversed(axes):  # torch.prod takes one dim at a time; the highest first keeps the others' indices
        x = x.prod(dim=ax, keepdim=keep)
    return [x]


def _einsum(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Einsum: ONNX's equation is numpy's (lowercase and uppercase labels, ``...``, implicit output), which
    ``torch.einsum`` reads as it is once the spaces are gone.

    Example:
        >>> _einsum(None, [torch.eye(2)], {"equation": "ii -> i"})[0]
        tensor([1., 1.])
    """
    eq = a.get("equation")
    if eq is None:
        raise UsageError("Einsum node without an 'equation' attribute; the ONNX model is malformed, re-export it")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    like = next((v for v in ins if isinstance(v, torch.Tensor)), None)
    ops = _gemm_dtype(*(_tensor(v, like) for v in ins))
    return [torch.einsum(eq, *ops)]


def _reduce(fn: str) -> Op:
    """ReduceMean / ReduceSum / ReduceMax / ReduceMin."""
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        axes, keep = _reduce_axes(x, ins, a), bool(a.get("keepdims", 1))
        if axes == []:
            return [x]
        if axes is None:
            axes = list(range(x.dim()))
        if fn == "mean":
            return [x.mean(dim=axes, keepdim=keep)]
        if fn == "sum":
            return [x.sum(dim=axes, keepdim=keep)]
        for ax in reversed(axes):  # amax/amin one axis at a time, the highest first, as the others keep their index
            x = (x.amax if fn == "max" else x.amin)(dim=ax, keepdim=keep)
        return [x]
    return run


OPS: dict[str, Op] = {
    "TopK": _topk, "ArgMax": _arg(True), "ArgMin": _arg(False),
    "ReduceMean": _reduce("mean"), "ReduceSum": _reduce("sum"),
    "ReduceMax": _reduce("max"), "ReduceMin": _reduce("min"),
    "ReduceL1": _norm_reduce(torch.abs, lambda s: s),
    "ReduceL2": _norm_reduce(lambda x: x * x, torch.sqrt),
    "ReduceSumSquare": _norm_reduce(lambda x: x * x, lambda s: s),
    "ReduceLogSum": _norm_reduce(lambda x: x, torch.log),
    "ReduceLogSumExp": _log_sum_exp,
    "ReduceProd": _prod,
    "Einsum": _einsum,
}
HOST_INPUTS: dict[str, tuple[int, ...]] = {"TopK": (1,)}  # K, as a Python number
