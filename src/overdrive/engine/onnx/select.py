"""The ONNX ops of overdrive's importer that reduce, pick or move elements by index: TopK (a detection head's best
boxes, beam search) and ArgMax / ArgMin (a classifier's label), as ``torch.topk`` / ``torch.argmax`` /
``torch.argmin``; the Reduce family (ReduceMean/Sum/Max/Min, and the norm-like ReduceL1, ReduceL2, ReduceSumSquare,
ReduceLogSum, ReduceLogSumExp, ReduceProd: ``torch.linalg.vector_norm`` and ``F.normalize`` export to ReduceL2,
``logsumexp`` to ReduceLogSumExp); Einsum, a sum over its contracted labels (``torch.einsum`` exports to it); the
gathers and scatters (GatherElements, GatherND, ScatterElements, ScatterND: detection heads, in-place index
assignment in exported code), OneHot, Size, NonZero of a constant; and DepthToSpace / SpaceToDepth
(super-resolution models, ``nn.PixelShuffle``, TensorFlow's ``depth_to_space``).

Reduce axes come from the second input (opset 18; ReduceSum from 13) or the ``axes`` attribute (before); no axes
reduce over all of them, unless ``noop_with_empty_axes`` is set, which leaves the elementwise part alone (|x| for
ReduceL1, x*x for ReduceSumSquare): a reduction over no axis.

Example:
    >>> sorted(k for k in OPS if k.startswith(("Arg", "Top", "Ein")))
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
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import Op, OpModule, Value, _floats, _gemm_dtype, _ints, _tensor


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


def _gather_elements(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    axis = int(a.get("axis", 0)) % x.dim()
    i = _tensor(ins[1]).to(x.device).long()
    return [torch.gather(x, axis, torch.where(i < 0, i + x.shape[axis], i))]


def _gather_nd(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """data (B..., D...), indices (B..., I..., k) -> (B..., I..., D[k:]): the first ``batch_dims`` dims pair up,
    the last index dim picks k dims of data. As advanced indexing: one arange per batch dim, one index per k."""
    x = _tensor(ins[0])
    idx = _tensor(ins[1]).to(x.device).long()
    b, k = int(a.get("batch_dims", 0)), idx.shape[-1]
    if isinstance(k, torch.SymInt):
        raise UsageError("GatherND with a dynamic index depth is not supported by the ONNX importer")
    rank = idx.dim() - 1
    index: list[torch.Tensor] = []
    for j in range(b):
        shape = [1] * rank
        shape[j] = -1
        index.append(torch.arange(x.shape[j], device=x.device).reshape(shape))
    for j in range(k):
        ij = idx[..., j]
        index.append(torch.where(ij < 0, ij + x.shape[b + j], ij))
    return [x[tuple(index)]]


# ONNX Scatter* reduction -> torch.scatter_reduce's; "none" is a plain scatter (the last write wins)
_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _reduction(op: str, a: dict) -> str | None:
    red = a.get("reduction", "none")
    red = red.decode() if isinstance(red, bytes) else str(red)
    if red != "none" and red not in _SCATTER_REDUCE:
        raise UsageError(f"{op} reduction={red!r} is not an ONNX reduction; expected one of none, add, mul, max, min")
    return _SCATTER_REDUCE.get(red)


def _scatter(x: torch.Tensor, dim: int, index: torch.Tensor, upd: torch.Tensor, red: str | None) -> torch.Tensor:
    upd = upd.to(x.dtype)
    if red is None:
        return torch.scatter(x, dim, index, upd)
    return torch.scatter_reduce(x, dim, index, upd, red, include_self=True)


def _scatter_elements(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """ScatterElements(data, indices, updates): ``out[..., indices[i], ...] = updates[i]`` along ``axis`` (indices
    and updates of one shape, negative indices counted from the end), or combined with data's value by
    ``reduction`` add / mul / max / min (opsets 16 and 18), duplicates included.

    Example:
        >>> x, i = torch.zeros(1, 3), torch.tensor([[1, 1]])
        >>> _scatter_elements(None, [x, i, torch.ones(1, 2)], {"axis": 1, "reduction": "add"})[0]
        tensor([[0., 2., 0.]])
    """
    x = _tensor(ins[0])
    axis = int(a.get("axis", 0)) % x.dim()
    i = _tensor(ins[1]).to(x.device).long()
    i = torch.where(i < 0, i + x.shape[axis], i)
    return [_scatter(x, axis, i, _tensor(ins[2], x), _reduction("ScatterElements", a))]


def _scatter_nd(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """ScatterND(data (D0..Dr-1), indices (I..., k), updates (I..., Dk...)): each index row names an element
    (k = r) or a slice (k < r) of data to replace, or to combine by ``reduction``. The first k dims of data are
    flattened to one, so every form is a scatter along dim 0 at the rows' linear positions."""
    x = _tensor(ins[0])
    idx = _tensor(ins[1]).to(x.device).long()
    k = idx.shape[-1]
    if isinstance(k, torch.SymInt):
        raise UsageError("ScatterND with a dynamic index depth is not supported by the ONNX importer")
    red = _reduction("ScatterND", a)
    lin = torch.zeros(idx.shape[:-1], dtype=torch.long, device=x.device)
    for j in range(k):  # row-major position among the first k dims, negative indices from the end
        ij = idx[..., j]
        lin = lin * x.shape[j] + torch.where(ij < 0, ij + x.shape[j], ij)
    rest = list(x.shape[k:])
    flat = x.reshape([-1, *rest])  # (D0*..*Dk-1, Dk...)
    upd = _tensor(ins[2], x).reshape([-1, *rest])  # (prod(I), Dk...)
    index = lin.reshape([-1] + [1] * len(rest)).expand(upd.shape)
    return [_scatter(flat, 0, index, upd, red).reshape(x.shape)]


def _one_hot(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """OneHot(indices, depth, values [off, on]): a new axis of length ``depth`` at ``axis`` (default -1), ``on``
    where it equals the index (a negative index counts from ``depth``), ``off`` elsewhere and for indices out of
    range. ``depth`` is read when the graph is built (a constant, as exporters write it)."""
    depth = int(_floats(ins[1])[0])  # any numeric type, floats included
    idx = _tensor(ins[0]).long()
    vals = _tensor(ins[2], idx)
    idx = torch.where(idx < 0, idx + depth, idx)
    axis = int(a.get("axis", -1)) % (idx.dim() + 1)
    shape = [1] * (idx.dim() + 1)
    shape[axis] = depth
    hot = idx.unsqueeze(axis) == torch.arange(depth, device=idx.device).reshape(shape)
    off, on = vals.reshape(-1)
    return [torch.where(hot, on, off)]


def _nonzero(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """NonZero of a build-time constant: (rank, count) int64 indices, folded on the host. Of a run-time tensor the
    output's length depends on the data, which a static-shape engine cannot hold: refused, naming the fix."""
    if isinstance(ins[0], np.ndarray) and ins[0].dtype != object:
        return [np.array(np.nonzero(ins[0]), dtype=np.int64).reshape(ins[0].ndim, -1)]
    raise UsageError("NonZero of a tensor computed at run time has a data-dependent output shape, which the "
                     "ONNX importer cannot build; use --backend onnxruntime, or export the model with a fixed-size "
                     "form (a mask and torch.where, or topk)")


def _size(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Size: the element count as an int64 scalar, on the host like Shape's output (symbolic under dynamic export)."""
    n = 1
    for d in ins[0].shape:
        n = n * d
    return [np.array(n, dtype=object if isinstance(n, torch.SymInt) else np.int64)]


def _depth_to_space(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """DepthToSpace (N, C*b*b, H, W) -> (N, C, H*b, W*b). DCR (the default, TensorFlow's depth_to_space) reads
    the channels as (b, b, C); CRD (``nn.PixelShuffle``) as (C, b, b)."""
    x, b = _tensor(ins[0]), int(a["blocksize"])
    mode = a.get("mode", "DCR")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in ("DCR", "CRD"):
        raise UsageError(f"DepthToSpace mode={mode!r} is not an ONNX mode; expected 'DCR' or 'CRD'")
    n, c, h, w = x.shape
    if mode == "CRD":
        return [F.pixel_shuffle(x, b)]
    y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)  # (N, C, H, b, W, b)
    return [y.reshape(n, c // (b * b), h * b, w * b)]


def _space_to_depth(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """SpaceToDepth (N, C, H*b, W*b) -> (N, b*b*C, H, W), channels ordered (b, b, C) as TensorFlow's."""
    x, b = _tensor(ins[0]), int(a["blocksize"])
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)  # (N, b, b, C, H, W)
    return [y.reshape(n, c * b * b, h // b, w // b)]


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
    "GatherElements": _gather_elements, "GatherND": _gather_nd,
    "ScatterElements": _scatter_elements, "Scatter": _scatter_elements, "ScatterND": _scatter_nd, "OneHot": _one_hot, "NonZero": _nonzero,
    "Size": _size, "DepthToSpace": _depth_to_space, "SpaceToDepth": _space_to_depth,
}
# read as Python numbers, by position: TopK's K, OneHot's depth and values
HOST_INPUTS: dict[str, tuple[int, ...]] = {"TopK": (1,), "OneHot": (1, 2)}
