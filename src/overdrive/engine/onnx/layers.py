"""The layer ONNX operators of overdrive's importer (``OPS``): MatMul and Gemm, Conv and ConvTranspose (1-3 D),
the pools, the norms (Batch, Layer, Instance, Group, LRN) and Softmax / LogSoftmax, as ``torch.nn.functional``
calls. Matrix products take one float dtype (:func:`values._gemm_dtype`); a norm's parameters follow its input's.

Example:
    >>> x = torch.ones(1, 1, 4, 4)
    >>> OPS["Conv"](None, [x, torch.ones(1, 1, 3, 3)], {"pads": [1, 1, 1, 1]})[0].shape
    torch.Size([1, 1, 4, 4])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import _DTYPES, Op, OpModule, Value, _flatten, _gemm_dtype, _like, _tensor


def _auto_pad(a: dict) -> str:
    ap = a.get("auto_pad", "NOTSET")
    ap = ap.decode() if isinstance(ap, bytes) else str(ap)
    if ap not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise UsageError(f"auto_pad={ap!r} is not an ONNX auto_pad; expected NOTSET, VALID, SAME_UPPER or SAME_LOWER")
    return ap


def _pads2d(a: dict, n: int, spatial: list | None = None, kernel: list | None = None
            ) -> tuple[list[int], list[int] | None]:
    """ONNX pads [b1, b2, ..., e1, e2, ...] -> symmetric padding or (None, F.pad list).

    auto_pad SAME_UPPER / SAME_LOWER (TensorFlow's "same", as tf2onnx and keras2onnx write it) pads each spatial
    axis so the output has ceil(in / stride) elements, the odd element at the end (UPPER) or the start (LOWER);
    VALID pads nothing. ``spatial`` (the input's spatial sizes) and ``kernel`` are needed for SAME."""
    ap = _auto_pad(a)
    if ap == "VALID":
        pads = [0] * (2 * n)
    elif ap.startswith("SAME"):
        strides, dil = list(a.get("strides", [1] * n)), list(a.get("dilations", [1] * n))
        total = [max((-(-i // s) - 1) * s + (k - 1) * d + 1 - i, 0)
                 for i, s, k, d in zip(spatial, strides, kernel, dil)]
        small = [t // 2 for t in total]
        big = [t - h for t, h in zip(total, small)]
        pads = small + big if ap == "SAME_UPPER" else big + small
    else:
        pads = list(a.get("pads", [0] * (2 * n)))
    begin, end = pads[:n], pads[n:]
    if begin == end:
        return begin, None
    fp: list[int] = []
    for b, e in zip(reversed(begin), reversed(end)):
        fp += [b, e]
    return [0] * n, fp


def _conv(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, w = _tensor(ins[0]), _tensor(ins[1], ins[0])
    b = _tensor(ins[2], x) if len(ins) > 2 and ins[2] is not None else None
    x, w, b = _gemm_dtype(x, w, b)
    n = w.dim() - 2
    pad, fpad = _pads2d(a, n, list(x.shape[2:]), list(w.shape[2:]))
    if fpad:
        x = F.pad(x, fpad)
    conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
    return [conv(x, w, b, list(a.get("strides", [1] * n)), pad, list(a.get("dilations", [1] * n)), int(a.get("group", 1)))]


def _conv_transpose(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """ConvTranspose: weight (C_in, C_out / group, k...). ONNX pads crop the full output (begin, end per dim), so
    uneven pads run with zero padding and are cropped after."""
    x, w = _tensor(ins[0]), _tensor(ins[1], ins[0])
    b = _tensor(ins[2], x) if len(ins) > 2 and ins[2] is not None else None
    x, w, b = _gemm_dtype(x, w, b)
    n = w.dim() - 2
    ap = _auto_pad(a)
    strides, dil = list(a.get("strides", [1] * n)), list(a.get("dilations", [1] * n))
    out_pad, group = list(a.get("output_padding", [0] * n)), int(a.get("group", 1))
    if "output_shape" in a or ap.startswith("SAME"):
        begin, end = _transpose_pads(a, ap, list(x.shape[2:]), list(w.shape[2:]), strides, dil, out_pad)
    else:
        pads = list(a.get("pads", [0] * (2 * n))) if ap == "NOTSET" else [0] * (2 * n)
        begin, end = pads[:n], pads[n:]
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
    if begin == end:
        return [conv(x, w, b, strides, begin, out_pad, group, dil)]
    y = conv(x, w, b, strides, 0, out_pad, group, dil)
    index = [slice(None)] * 2 + [slice(p, y.shape[2 + i] - q) for i, (p, q) in enumerate(zip(begin, end))]
    return [y[tuple(index)]]


def _transpose_pads(a: dict, ap: str, spatial: list, kernel: list, strides: list, dil: list, out_pad: list
                    ) -> tuple[list, list]:
    """ConvTranspose's pads from ``output_shape`` (the last spatial sizes) or auto_pad SAME (in * stride): the full
    output cropped to that size, an odd element cropped at the end for SAME_UPPER, at the start for SAME_LOWER and
    for an explicit output_shape (the ONNX rule, as ONNX Runtime computes it)."""
    n = len(spatial)
    full = [(i - 1) * s + p + (k - 1) * d + 1 for i, s, p, k, d in zip(spatial, strides, out_pad, kernel, dil)]
    want = list(a["output_shape"])[-n:] if "output_shape" in a else [i * s for i, s in zip(spatial, strides)]
    total = [f - o for f, o in zip(full, want)]
    if any(t < 0 for t in total):
        raise UsageError(f"ConvTranspose output_shape {want} is larger than the full transposed convolution's output "
                         f"{full}; expected at most {full}; re-export the model with output_padding instead")
    small = [t // 2 for t in total]
    big = [t - h for t, h in zip(total, small)]
    return (small, big) if ap == "SAME_UPPER" else (big, small)


def _pool(kind: str) -> Callable:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x, k = _tensor(ins[0]), list(a["kernel_shape"])
        n = len(k)
        pad, fpad = _pads2d(a, n, list(x.shape[2:]), k)
        if fpad:
            x = F.pad(x, fpad, value=-math.inf if kind == "max" else 0.0)
        strides, ceil = list(a.get("strides", [1] * n)), bool(a.get("ceil_mode", 0))
        if kind == "max":
            fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]
            return [fn(x, k, strides, pad, list(a.get("dilations", [1] * n)), ceil)]
        fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[n - 1]
        include = bool(a.get("count_include_pad", 0))
        if fpad and not include:
            # the uneven pads were added as zeros above, where the average must not count them: divide the
            # window sums by the number of real elements in each window (pooled from a mask padded alike)
            ones = F.pad(torch.ones_like(_tensor(ins[0])[:1, :1]), fpad)
            return [fn(x, k, strides, pad, ceil, True) / fn(ones, k, strides, pad, ceil, True)]
        return [fn(x, k, strides, pad, ceil, include)]
    return run


def _gemm(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, w = _gemm_dtype(_tensor(ins[0]), _tensor(ins[1], ins[0]))
    x = x.t() if a.get("transA", 0) else x
    w = w.t() if a.get("transB", 0) else w
    y = float(a.get("alpha", 1.0)) * (x @ w)
    if len(ins) > 2 and ins[2] is not None:
        y = y + float(a.get("beta", 1.0)) * _tensor(ins[2], x).to(y.dtype)
    return [y]


def _follow(v: Value, x: torch.Tensor) -> torch.Tensor:
    """A norm's scale, bias or statistics in its input's dtype: in a half build an input the graph casts to fp32
    (statistics the model computes in fp32) meets fp16 weights, and the norm then runs in fp32, as the model asks."""
    t = _tensor(v, x)
    return t.to(x.dtype) if t.is_floating_point() and x.is_floating_point() and t.dtype != x.dtype else t


def _layernorm(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """LayerNormalization over the axes from ``axis`` on. Scale and bias broadcast against the input (numpy rules:
    a (C,) scale under axis=1, a (1, D) one under axis=-1); where they have the normalized shape, ``F.layer_norm``
    runs fused. Mean and InvStdDev (shape x.shape[:axis] + ones, in ``stash_type``, float32 by default) are
    computed where the node lists them (the importer sets ``_stats``)."""
    x = _tensor(ins[0])
    axis = int(a.get("axis", -1)) % x.dim()
    shape, eps = list(x.shape[axis:]), float(a.get("epsilon", 1e-5))
    w = _follow(ins[1], x)
    b = _follow(ins[2], x) if len(ins) > 2 and ins[2] is not None else None
    fused = list(w.shape) == shape and (b is None or list(b.shape) == shape)
    if fused and not a.get("_stats"):
        return [F.layer_norm(x, shape, w, b, eps)]
    stash = _DTYPES.get(int(a.get("stash_type", 1)), torch.float32)
    if not (stash.is_floating_point and x.is_floating_point()):
        raise UsageError(f"LayerNormalization stash_type={a.get('stash_type')} or input dtype {x.dtype} is not a "
                         "floating type; expected float inputs and stash_type 1 (float32); re-export the model")
    dims = list(range(axis, x.dim()))
    xs = x.to(stash)
    mean = xs.mean(dim=dims, keepdim=True)  # (x.shape[:axis], 1, ...)
    inv = torch.rsqrt(xs.var(dim=dims, unbiased=False, keepdim=True) + eps)
    if fused:
        y = F.layer_norm(x, shape, w, b, eps)
    else:
        y = (xs - mean) * inv * w.to(stash)  # in the stash type, rounded to x's once, as ONNX Runtime does
        y = (y + b.to(stash) if b is not None else y).to(x.dtype)
    return [y, mean, inv]


def _batchnorm(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    w, b, mean, var = (_follow(v, x) for v in ins[1:5])
    return [F.batch_norm(x, mean, var, w, b, False, 0.0, float(a.get("epsilon", 1e-5)))]


def _instance_norm(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    w, b = _follow(ins[1], x), _follow(ins[2], x)
    return [F.instance_norm(x, weight=w, bias=b, eps=float(a.get("epsilon", 1e-5)))]


def _group_norm(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """GroupNormalization: opsets 18-20 give scale and bias per group, 21 on per channel."""
    x = _tensor(ins[0])
    g = int(a["num_groups"])
    w, b = _follow(ins[1], x), _follow(ins[2], x)
    if w.numel() == g and x.shape[1] != g:  # per group: each group's value for its C/G channels
        w, b = w.repeat_interleave(x.shape[1] // g), b.repeat_interleave(x.shape[1] // g)
    return [F.group_norm(x, g, w, b, float(a.get("epsilon", 1e-5)))]


def _lrn(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """LRN (AlexNet, GoogLeNet): x / (bias + alpha / size * sum of x^2 over channels c - floor((size - 1) / 2) ..
    c + ceil((size - 1) / 2)) ** beta. ``F.local_response_norm`` centres an even window one channel lower."""
    x, size = _tensor(ins[0]), int(a["size"])
    lo = (size - 1) // 2
    sq = F.pad((x * x).movedim(1, -1), (lo, size - 1 - lo))  # (N, ..., C + size - 1): channels last, zero-padded
    win = sq.unfold(-1, size, 1).sum(-1).movedim(-1, 1)  # (N, C, ...)
    return [x / (float(a.get("bias", 1.0)) + float(a.get("alpha", 1e-4)) / size * win) ** float(a.get("beta", 0.75))]


def _softmax(fn: Callable) -> Callable:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        if m.opset >= 13:
            return [fn(x, dim=int(a.get("axis", -1)))]
        # opset < 13: the input is coerced to 2-D at ``axis`` (default 1) and normalized over the second part
        return [fn(_flatten(x, int(a.get("axis", 1))), dim=1).reshape(x.shape)]
    return run


OPS: dict[str, Op] = {
    "MatMul": lambda m, ins, a: [torch.matmul(*_gemm_dtype(_tensor(ins[0]), _tensor(ins[1], _like(ins))))],
    "Gemm": _gemm, "Conv": _conv, "ConvTranspose": _conv_transpose, "MaxPool": _pool("max"),
    "AveragePool": _pool("avg"),
    "GlobalAveragePool": lambda m, ins, a: [_tensor(ins[0]).mean(dim=tuple(range(2, ins[0].dim())), keepdim=True)],
    "GlobalMaxPool": lambda m, ins, a: [_tensor(ins[0]).amax(dim=tuple(range(2, ins[0].dim())), keepdim=True)],
    "BatchNormalization": _batchnorm, "LayerNormalization": _layernorm, "InstanceNormalization": _instance_norm,
    "GroupNormalization": _group_norm, "LRN": _lrn, "Softmax": _softmax(torch.softmax),
    "LogSoftmax": _softmax(torch.log_softmax),
}
