"""The ONNX ops of overdrive's importer that reduce, pick or move elements by index: TopK (a detection head's best
boxes, beam search; a stable ``torch.sort``, so ties come lowest index first as ONNX orders them) and ArgMax /
ArgMin (a classifier's label, ``torch.argmax`` / ``torch.argmin``); the Reduce family (ReduceMean/Sum/Max/Min, and
the norm-like ReduceL1, ReduceL2, ReduceSumSquare, ReduceLogSum, ReduceLogSumExp, ReduceProd:
``torch.linalg.vector_norm`` and ``F.normalize`` export to ReduceL2, ``logsumexp`` to ReduceLogSumExp); Einsum, a
sum over its contracted labels (``torch.einsum`` exports to it); the gathers and scatters (GatherElements, GatherND,
ScatterElements, ScatterND: detection heads, in-place index assignment in exported code), OneHot, Size, NonZero of a
constant; and DepthToSpace / SpaceToDepth (super-resolution models, ``nn.PixelShuffle``, TensorFlow's
``depth_to_space``); and Resize, as ``F.interpolate`` or, for nearest in the other coordinate modes, a gather of the
input indices ONNX Runtime computes, with Upsample (opsets 7-9) and Resize-10 in their asymmetric coordinates.

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

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import Op, OpModule, Value, _floats, _gemm_dtype, _ints, _tensor


def _topk(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """TopK(X, K) -> (Values, Indices int64) along ``axis`` (default -1), the largest first (``largest`` 1) or the
    smallest, equal values lowest index first; ``sorted`` 0 lets the order be any, which the sorted order
    satisfies. K is read on the host (a constant, a size computed from the input's shape, or opset 1-9's ``k``)."""
    x = _tensor(ins[0])
    k = _ints(ins[1])[0] if len(ins) > 1 else int(a["k"])  # opset 1-9: K is an attribute
    axis = int(a.get("axis", -1))
    # equal values come lowest index first (the spec's tie-break, which ONNX Runtime keeps); torch.topk orders ties
    # arbitrarily, so a stable sort picks them (quantized scores tie often)
    values, idx = torch.sort(x, dim=axis, descending=bool(a.get("largest", 1)), stable=True)
    return [values.narrow(axis, 0, k), idx.narrow(axis, 0, k)]


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


def _keep_dtype(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A reduction's output in its input's type, as ONNX defines it: torch sums and multiplies int8-int32 into
    int64 (an int32 ReduceSum came out int64, and a later Concat or Add with int32 data failed)."""
    return y if y.dtype == x.dtype or x.is_floating_point() else y.to(x.dtype)


def _norm_reduce(elementwise: Callable[[torch.Tensor], torch.Tensor], after: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Op:
    """A reduction as ``after(sum(elementwise(x)))`` over the axes (ReduceL2: sqrt of the sum of squares)."""
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        axes, keep = _reduce_axes(x, ins, a), bool(a.get("keepdims", 1))
        if axes == []:
            return [_keep_dtype(after(elementwise(x)), x)]
        return [_keep_dtype(after(elementwise(x).sum(dim=axes if axes is not None else None, keepdim=keep)), x)]
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
    y = x
    for ax in reversed(axes):  # torch.prod takes one dim at a time; the highest first keeps the others' indices
        y = y.prod(dim=ax, keepdim=keep)
    return [_keep_dtype(y, x)]


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
        if fn == "mean" and not x.is_floating_point():  # integers: the sum divided by the count, truncated (ONNX
            count = math.prod(x.shape[ax] for ax in axes)  # Runtime's int32 mean of [-7, 2, 3] is 0, not -1)
            return [torch.div(x.sum(dim=axes, keepdim=keep), count, rounding_mode="trunc").to(x.dtype)]
        if fn == "mean":
            return [x.mean(dim=axes, keepdim=keep)]
        if fn == "sum":
            return [_keep_dtype(x.sum(dim=axes, keepdim=keep), x)]
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


def _resize(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Resize as ``F.interpolate``, for the modes PyTorch exporters write: nearest (asymmetric + floor:
    ``mode="nearest"``; half_pixel + round_prefer_ceil: ``"nearest-exact"``), linear and cubic (half_pixel or
    pytorch_half_pixel: ``align_corners=False``; align_corners: ``True``; cubic with a = -0.75, PyTorch's);
    nearest in any other coordinate mode and rounding by ``_resize_gather``, linear in asymmetric (TensorFlow's
    ``resize_bilinear``), half_pixel_symmetric and tf_half_pixel_for_nn by ``_resize_linear``. Anything else
    raises, naming it."""
    x = _tensor(ins[0])
    attr = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items()}
    if getattr(m, "opset", 18) < 11 and len(ins) == 2:  # Resize-10 (X, scales): Upsample's meaning
        return _upsample(m, ins, a)
    mode, ctm = attr.get("mode", "nearest"), attr.get("coordinate_transformation_mode", "half_pixel")
    near = attr.get("nearest_mode", "round_prefer_floor")
    scales = _floats(ins[2]) if len(ins) > 2 and ins[2] is not None and np.asarray(ins[2]).size else None
    sizes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    if attr.get("axes") is not None:  # opset 18: scales/sizes for these axes only
        full_s, full_z = [1.0] * x.dim(), list(x.shape)
        for i, ax in enumerate(attr["axes"]):
            if scales is not None:
                full_s[ax % x.dim()] = scales[i]
            if sizes is not None:
                full_z[ax % x.dim()] = sizes[i]
        scales, sizes = (full_s if scales is not None else None), (full_z if sizes is not None else None)
    bad, hint = None, ""
    if attr.get("antialias", 0) or attr.get("exclude_outside", 0) \
            or attr.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        bad = "antialias / exclude_outside / keep_aspect_ratio_policy"
    elif mode == "nearest":
        if (ctm, near) == ("asymmetric", "floor"):
            tmode = "nearest"
        elif ctm in ("half_pixel", "pytorch_half_pixel") and near == "round_prefer_ceil":
            tmode = "nearest-exact"
        elif ctm in _COORD and near in _ROUND:  # the ONNX default (half_pixel, round_prefer_floor), TF's modes
            tmode = "gather"
        else:
            bad = f"nearest with coordinate_transformation_mode={ctm!r}, nearest_mode={near!r}"
    elif mode == "linear" and ctm in ("asymmetric", "half_pixel_symmetric", "tf_half_pixel_for_nn"):
        tmode = "linear_gather"  # F.interpolate has no such coordinate mode: two gathers and a lerp per axis
    elif mode in ("linear", "cubic"):
        if ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            bad = f"{mode} with coordinate_transformation_mode={ctm!r}"
            hint = (f"; supported for {mode}: half_pixel, pytorch_half_pixel, align_corners"
                    + (", asymmetric, half_pixel_symmetric, tf_half_pixel_for_nn; re-export with one of those"
                       if mode == "linear" else "; re-export with one of those, or with mode='linear', which also "
                       "takes asymmetric"))
        elif mode == "cubic" and (abs(float(attr.get("cubic_coeff_a", -0.75)) + 0.75) > 1e-6 or x.dim() != 4):
            bad = "cubic other than 2-D with cubic_coeff_a=-0.75"
        elif mode == "linear" and not 3 <= x.dim() <= 5:
            bad = f"linear on a {x.dim()}-D input"
        tmode = "bicubic" if mode == "cubic" else ("linear", "bilinear", "trilinear")[x.dim() - 3]
    else:
        bad = f"mode={mode!r}"
    if bad is None and scales is not None and any(float(v) != 1.0 for v in scales[:2]):
        bad = "scales on the batch or channel axis"
    if bad is None and sizes is not None and any(not isinstance(s, torch.SymInt) and not isinstance(d, torch.SymInt)
                                                 and s != d for s, d in zip(sizes[:2], x.shape[:2])):
        bad = "sizes on the batch or channel axis"
    if bad:
        raise UsageError(f"Resize {bad} is not supported by the ONNX importer{hint}")
    if tmode == "gather":
        return [_resize_gather(x, sizes, scales, ctm, near)]
    if tmode == "linear_gather":
        return [_resize_linear(x, sizes, scales, ctm)]
    align = None if tmode.startswith("nearest") else (ctm == "align_corners")
    if ctm == "pytorch_half_pixel":
        x, sizes, scales = _single_outputs(x, sizes, scales)
    if sizes is not None:
        return [F.interpolate(x, size=list(sizes[2:]), mode=tmode, align_corners=align)]
    # with scale_factor (and recompute_scale_factor unset) PyTorch maps output to input coordinates by
    # 1 / scale, as ONNX does; the output size is floor(input * scale) in both
    return [F.interpolate(x, scale_factor=[float(v) for v in scales[2:]], mode=tmode, align_corners=align)]


def _upsample(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Upsample (opsets 7-9: ``torch.onnx.export`` at opset 9 writes it for ``F.interpolate``) and Resize-10: scales
    as an attribute (opset 7) or the second input, coordinates asymmetric (output o reads input o / scale); nearest
    rounds down on an axis scaled up and up on one scaled down, as ONNX Runtime does; linear interpolates between
    the two neighbours, clamped at the edge.

    Example:
        >>> _upsample(None, [torch.tensor([[[0.0, 1.0]]]), np.array([1, 1, 2], np.float32)], {"mode": b"nearest"})[0]
        tensor([[[0., 0., 1., 1.]]])
    """
    x = _tensor(ins[0])
    mode = a.get("mode", "nearest")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    scales = _floats(ins[1]) if len(ins) > 1 and ins[1] is not None else [float(v) for v in a.get("scales", [])]
    if len(scales) != x.dim():
        raise UsageError(f"Upsample/Resize-10 has {len(scales)} scales for a {x.dim()}-D input; expected one per axis "
                         "(the ONNX model is malformed, re-export it)")
    if mode not in ("nearest", "linear", "bilinear"):
        raise UsageError(f"Upsample/Resize-10 mode={mode!r} is not supported by the ONNX importer; expected nearest "
                         "or linear (re-export at opset 11 or later for other modes)")
    if x.dim() < 3 or any(float(v) != 1.0 for v in scales[:2]):
        raise UsageError(f"Upsample/Resize-10 with scales {scales} is not supported by the ONNX importer; expected "
                         "scale 1 on the batch and channel axes of an (N, C, ...) input")
    if mode == "nearest":
        return [_resize_gather(x, None, scales, "asymmetric", "simple")]
    return [_resize_linear(x, None, scales, "asymmetric")]


# output coordinate o -> input coordinate, ONNX's coordinate_transformation_mode (s: scale, n / m: in / out length)
_COORD = {"half_pixel": lambda o, s, n, m: (o + 0.5) / s - 0.5,
          "pytorch_half_pixel": lambda o, s, n, m: (o + 0.5) / s - 0.5 if m > 1 else 0 * o,
          "align_corners": lambda o, s, n, m: o * np.float32(n - 1) / np.float32(m - 1) if m > 1 else 0 * o,
          "asymmetric": lambda o, s, n, m: o / s, "tf_half_pixel_for_nn": lambda o, s, n, m: (o + 0.5) / s,
          "half_pixel_symmetric": lambda o, s, n, m: np.float32(n / 2) * (1 - np.float32(m) / (s * n)) + (o + 0.5) / s - 0.5}
_ROUND = {"round_prefer_floor": lambda v: np.ceil(v - 0.5), "round_prefer_ceil": lambda v: np.floor(v + 0.5),
          "floor": np.floor, "ceil": np.ceil}


def _axis_resize(x: torch.Tensor, ax: int, sizes: list | None, scales: list[float] | None, what: str
                 ) -> tuple[int, int, np.float32]:
    """(input size, output size, float32 scale) of Resize on axis ``ax``: the output size floor(n * scale) as ONNX
    Runtime sizes it when only scales are given; a dynamic axis is refused (the indices are worked out on the host)."""
    n = x.shape[ax]
    m = sizes[ax] if sizes is not None else None
    if isinstance(n, torch.SymInt) or isinstance(m, torch.SymInt):
        raise UsageError(f"Resize {what} over a dynamic spatial axis is not supported; export with fixed spatial sizes")
    s = np.float32(m) / np.float32(n) if m is not None else np.float32(scales[ax])
    return n, (m if m is not None else int(np.float32(n) * s)), s


def _resize_gather(x: torch.Tensor, sizes: list | None, scales: list[float] | None, ctm: str, near: str) -> torch.Tensor:
    """Nearest Resize for any coordinate mode and rounding, as one ``index_select`` per spatial axis; the input index
    of each output index is worked out on the host in float32, as ONNX Runtime does, so ties round alike."""
    for ax in range(2, x.dim()):
        n, m, s = _axis_resize(x, ax, sizes, scales, f"nearest with coordinate_transformation_mode={ctm!r}, "
                                                    f"nearest_mode={near!r}")
        o = np.arange(m, dtype=np.float32)
        # "simple" (Upsample, Resize-10): down on an axis scaled up, up on one scaled down
        rnd = _ROUND[near] if near != "simple" else (np.floor if s >= 1 else np.ceil)
        idx = np.clip(rnd(np.float32(_COORD[ctm](o, s, n, m))), 0, n - 1).astype(np.int64)
        x = x.index_select(ax, torch.from_numpy(idx).to(x.device))
    return x


def _resize_linear(x: torch.Tensor, sizes: list | None, scales: list[float] | None, ctm: str) -> torch.Tensor:
    """Linear Resize in a coordinate mode ``F.interpolate`` lacks (asymmetric: TensorFlow's ``resize_bilinear``
    without half-pixel centres), one spatial axis at a time: each output index reads its two neighbouring input
    indices and a weight, worked out on the host in float32 and clamped to the input as ONNX Runtime does.

    Example:
        >>> _resize_linear(torch.tensor([[[0.0, 1.0]]]), None, [1.0, 1.0, 2.0], "asymmetric")
        tensor([[[0.0000, 0.5000, 1.0000, 1.0000]]])
    """
    for ax in range(2, x.dim()):
        n, m, s = _axis_resize(x, ax, sizes, scales, f"linear with coordinate_transformation_mode={ctm!r}")
        if m == n and s == 1:
            continue
        pos = np.clip(np.float32(_COORD[ctm](np.arange(m, dtype=np.float32), s, n, m)), 0, n - 1).astype(np.float32)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, n - 1)
        shape = [1] * x.dim()
        shape[ax] = m
        w = torch.from_numpy(pos - lo).to(x.device, x.dtype).reshape(shape)  # (1, .., m, .., 1)
        a = x.index_select(ax, torch.from_numpy(lo).to(x.device))
        b = x.index_select(ax, torch.from_numpy(hi).to(x.device))
        x = a + (b - a) * w
    return x


def _single_outputs(x: torch.Tensor, sizes: list | None, scales: list[float] | None
                    ) -> tuple[torch.Tensor, list | None, list[float] | None]:
    """pytorch_half_pixel reads input coordinate 0 for an output axis of length 1 (its first element), where
    half_pixel, and so ``F.interpolate``, reads the input's centre. Such an axis is cut to its first element,
    which every mode returns exactly at coordinate 0, and resized 1 -> 1. Symbolic sizes are left as they are."""
    out = list(sizes[2:]) if sizes is not None else [
        None if isinstance(d, torch.SymInt) else math.floor(d * s) for d, s in zip(x.shape[2:], scales[2:])]
    ones = [i for i, o in enumerate(out) if not isinstance(o, torch.SymInt) and o == 1]
    for i in ones:
        x = x.narrow(2 + i, 0, 1)
    if sizes is not None:
        return x, sizes, scales
    return x, sizes, [1.0 if i - 2 in ones else s for i, s in enumerate(scales)]



OPS: dict[str, Op] = {
    "Resize": _resize, "Upsample": _upsample,
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
HOST_INPUTS: dict[str, tuple[int, ...]] = {"TopK": (1,), "OneHot": (1, 2), "Upsample": (1,)}
