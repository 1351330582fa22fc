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
from overdrive.engine.onnx.values import Op, OpModule, Value, _flatten, _gemm_dtype, _like, _tensor


def _pads2d(a: dict, n: int) -> tuple[list[int], list[int] | None]:
    """ONNX pads [b1, b2, ..., e1, e2, ...] -> symmetric padding or (None, F.pad list)."""
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise UsageError(f"auto_pad={a['auto_pad']!r} is not supported by the ONNX importer; re-export with explicit pads")
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
    pad, fpad = _pads2d(a, n)
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
    if "output_shape" in a or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise UsageError("ConvTranspose with output_shape or auto_pad SAME is not supported by the ONNX importer; "
                         "re-export with explicit pads")
    pads = list(a.get("pads", [0] * (2 * n)))
    begin, end = pads[:n], pads[n:]
    strides, dil = list(a.get("strides", [1] * n)), list(a.get("dilations", [1] * n))
    out_pad, group = list(a.get("output_padding", [0] * n)), int(a.get("group", 1))
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
    if begin == end:
        return [conv(x, w, b, strides, begin, out_pad, group, dil)]
    y = conv(x, w, b, strides, 0, out_pad, group, dil)
    index = [slice(None)] * 2 + [slice(p, y.shape[2 + i] - q) for i, (p, q) in enumerate(zip(begin, end))]
    return [y[tuple(index)]]


def _pool(kind: str) -> Callable:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x, k = _tensor(ins[0]), list(a["kernel_shape"])
        n = len(k)
        pad, fpad = _pads2d(a, n)
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
    x = _tensor(ins[0])
    axis = int(a.get("axis", -1)) % x.dim()
    shape = list(x.shape[axis:])
    w = _follow(ins[1], x)
    b = _follow(ins[2], x) if len(ins) > 2 and ins[2] is not None else None
    return [F.layer_norm(x, shape, w, b, float(a.get("epsilon", 1e-5)))]


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
