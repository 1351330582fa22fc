"""The ONNX operators overdrive's importer runs, one function per op (``OPS``), each taking the module, the
input values and the node's attributes and returning the output values. Shape arithmetic stays on the host
(numpy), device data goes through torch functions that ``torch.export`` traces. QuantizeLinear and
DequantizeLinear are in ``qdq.py``; ``importer.py`` merges both tables.

Example:
    >>> "Conv" in OPS and "QuantizeLinear" not in OPS
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import (_DTYPES, _NP, Op, OpModule, Value, _as_value, _floats, _from_numpy,
                                          _gemm_dtype, _host, _ints, _like, _tensor)


def _binary(np_fn: Callable, t_fn: Callable) -> Callable:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x, y = ins
        if _host(x, y):
            out = _as_value(np_fn(x, y))  # 0-d object operands give a bare (Sym)int back
            # back to x's dtype (int64 + float32 scalars), never for a symbolic result: int() of a SymInt would
            # fix that size in the trace (int64 1 + the sequence length made the sequence static)
            cast = out.dtype != x.dtype and x.dtype != object and out.dtype != object and np_fn not in _CMP
            return [out.astype(x.dtype) if cast else out]
        like = _like(ins)
        return [t_fn(_tensor(x, like), _tensor(y, like))]
    return run


def _unary(t_fn: Callable) -> Callable:
    return lambda m, ins, a: [t_fn(_tensor(ins[0]))]


_CMP = (np.equal, np.less, np.greater, np.less_equal, np.greater_equal, np.logical_and, np.logical_or, np.logical_xor)


def _pow(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """ONNX Pow: the result has the base's type, so an integer base with a float exponent truncates back to the
    integer (int64 3 ** 0.5 = 1, as ONNX Runtime computes it); torch.pow would promote it to float32."""
    x, y = ins
    if _host(x, y):
        return _binary(np.power, torch.pow)(m, ins, a)
    like = _like(ins)
    xt, yt = _tensor(x, like), _tensor(y, like)
    if not xt.is_floating_point() and yt.is_floating_point():
        return [torch.pow(xt.double(), yt.double()).to(xt.dtype)]  # double: exact for int64 bases up to 2**53
    out = torch.pow(xt, yt)
    return [out.to(xt.dtype) if out.dtype != xt.dtype else out]


def _div_np(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ONNX Div: integer division truncates toward zero (-7 / 2 = -3), unlike numpy's floor division."""
    if x.dtype.kind in "iu":
        q = np.abs(x) // np.abs(y)
        return (q * np.sign(x) * np.sign(y)).astype(np.result_type(x, y))
    return np.floor_divide(x, y) if x.dtype.kind == "O" else np.divide(x, y)  # object: sizes (>= 0), maybe symbolic


def _div_t(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ONNX Div on tensors: integers truncate and stay integers (torch.div would give floats)."""
    if not x.is_floating_point() and not y.is_floating_point():
        return torch.div(x, y, rounding_mode="trunc")
    return torch.div(x, y)


def _axes(ins: list[Value], a: dict, idx: int = 1) -> list[int] | None:
    if len(ins) > idx and ins[idx] is not None:
        return _ints(ins[idx])
    return list(a["axes"]) if "axes" in a else None


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


def _reshape(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, shape = ins[0], _ints(ins[1])
    if not a.get("allowzero", 0):
        shape = [x.shape[i] if (not isinstance(s, torch.SymInt) and s == 0) else s for i, s in enumerate(shape)]
    if isinstance(x, np.ndarray):
        return [x.reshape(shape)]
    return [x.reshape(shape)]


def _shape(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    dims = list(ins[0].shape)
    dims = dims[a.get("start", 0):a.get("end", len(dims))]
    sym = any(isinstance(d, torch.SymInt) for d in dims)
    return [np.array(dims, dtype=object if sym else np.int64)]


def _gather(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, idx, axis = ins[0], ins[1], int(a.get("axis", 0))
    if _host(x, idx):
        return [np.take(x, idx, axis=axis)]
    x = _tensor(x)
    axis %= x.dim()  # a negative axis: the shape arithmetic below needs its positive form
    i = _tensor(idx, None).to(x.device).long()
    i = torch.where(i < 0, i + x.shape[axis], i)
    if i.dim() == 0:
        return [x.select(axis, i) if isinstance(idx, torch.Tensor) else x.select(axis, int(np.asarray(idx)))]
    return [torch.index_select(x, axis, i.reshape(-1)).reshape(*x.shape[:axis], *i.shape, *x.shape[axis + 1:])]


def _slice(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = ins[0]
    starts, ends = _ints(ins[1]), _ints(ins[2])
    axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    if isinstance(x, np.ndarray) and x.dtype != object and any(isinstance(v, torch.SymInt) for v in starts + ends):
        # a host constant (position ids) cut at a symbolic length: numpy would read the SymInt as an int and fix
        # the sequence length at the traced one, so the constant becomes a tensor on the module's device
        dev = next(iter(m.buffers()), torch.empty(0)).device
        x = _tensor(x).to(dev)
    index = [slice(None)] * len(x.shape)
    big = 2**62
    for s, e, ax, st in zip(starts, ends, axes, steps):
        if st < 0:
            x, index[ax] = _slice_reversed(x, ax, s, e, st)
            continue
        if not isinstance(e, torch.SymInt) and abs(e) >= big:  # INT64_MAX: to the end; INT64_MIN: before the start
            e = None if e > 0 else 0
        if not isinstance(s, torch.SymInt) and abs(s) >= big:
            s = 0 if s < 0 else x.shape[ax]
        index[ax] = slice(s, e, st)
    return [x[tuple(index)]]


def _slice_reversed(x: Value, ax: int, s: int, e: int, st: int) -> tuple[Value, slice]:
    """One axis of a Slice with a negative step, as (x, a positive-step slice of x).

    ONNX clamps start to [0, n-1] and end to [-1, n-1] (-1: past the first element), after adding n to
    negative values; Python reads an end of -1 as the last element instead. torch has no negative steps,
    so tensors are flipped: element i of x is element n-1-i of the flipped x."""
    n = x.shape[ax]
    if isinstance(n, torch.SymInt) or isinstance(s, torch.SymInt) or isinstance(e, torch.SymInt):
        raise UsageError("Slice with a negative step over a dynamic dimension is not supported by the ONNX importer")
    s = min(max(s + n if s < 0 else s, 0), n - 1)
    e = min(max(e + n if e < 0 else e, -1), n - 1)
    if isinstance(x, np.ndarray):
        return x, slice(s, None if e < 0 else e, st)
    return x.flip(ax), slice(n - 1 - s, n - 1 - e, -st)


def _unsqueeze(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, axes = ins[0], _axes(ins, a)
    rank = len(x.shape) + len(axes)
    for ax in sorted(ax % rank for ax in axes):
        x = np.expand_dims(x, ax) if isinstance(x, np.ndarray) else x.unsqueeze(ax)
    return [x]


def _squeeze(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, axes = ins[0], _axes(ins, a)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = tuple(ax % len(x.shape) for ax in axes)
    return [np.squeeze(x, axes) if isinstance(x, np.ndarray) else x.squeeze(axes)]


def _concat(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    ins = [v for v in ins if v is not None]
    if _host(*ins):
        return [np.concatenate(ins, axis=int(a["axis"]))]
    like = _like(ins)
    return [torch.cat([_tensor(v, like) for v in ins], dim=int(a["axis"]))]


def _cast(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    dt = _DTYPES[int(a["to"])]
    if isinstance(ins[0], np.ndarray) and dt in _NP:
        return [ins[0] if ins[0].dtype == object else ins[0].astype(_NP[dt])]
    return [_tensor(ins[0]).to(dt)]


def _split(m: OpModule, ins: list[Value], a: dict, n_out: int) -> list[Value]:
    x, axis = _tensor(ins[0]), int(a.get("axis", 0))
    sizes = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(a.get("split", []))
    if not sizes:  # opset 18 num_outputs: equal parts of ceil(n / k), the last one smaller when n % k != 0
        part = math.ceil(x.shape[axis] / n_out)
        sizes = [part] * (n_out - 1) + [x.shape[axis] - part * (n_out - 1)]
    return list(torch.split(x, sizes, dim=axis))


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


def _clip(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else a.get("min")
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("max")
    x = _tensor(ins[0])
    if lo is None and hi is None:  # both bounds optional: no clipping (torch.clamp refuses two Nones)
        return [x]
    # integer tensors take integer bounds: float ones promoted int64 ids to float32 (2**24 + 1 came out 2**24)
    num = float if x.is_floating_point() else int
    f = (lambda v: None if v is None else num(np.asarray(v)) if not isinstance(v, torch.Tensor) else num(v))
    return [x.clamp(f(lo), f(hi))]


def _where(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    if _host(*ins):
        return [np.where(*ins)]
    like = _like(ins)
    c, x, y = (_tensor(v, like) for v in ins)
    return [torch.where(c.bool(), x, y)]


def _expand(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, shape = _tensor(ins[0]), _ints(ins[1])
    # ONNX Expand broadcasts both ways (a 1 in `shape` keeps x's size); torch expand does not.
    rank = max(x.dim(), len(shape))
    xs = [1] * (rank - x.dim()) + list(x.shape)
    shape = [1] * (rank - len(shape)) + shape
    target = [d if (not isinstance(s, torch.SymInt) and s == 1) else s for s, d in zip(shape, xs)]
    return [x.reshape(xs).expand(target)]


def _const_of_shape(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    val = a.get("value", np.zeros(1, np.float32))
    shape = _ints(ins[0])
    if not any(isinstance(s, torch.SymInt) for s in shape):
        return [np.full(shape, val.reshape(-1)[0], dtype=val.dtype)]
    return [torch.full(shape, val.reshape(-1)[0].item(), dtype=_from_numpy(val).dtype)]  # a copy: val is read-only


def _softmax(fn: Callable) -> Callable:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        if m.opset >= 13:
            return [fn(x, dim=int(a.get("axis", -1)))]
        # opset < 13: the input is coerced to 2-D at ``axis`` (default 1) and normalized over the second part
        return [fn(_flatten(x, int(a.get("axis", 1))), dim=1).reshape(x.shape)]
    return run


def _gelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    approx = a.get("approximate", b"none")
    return [F.gelu(_tensor(ins[0]), approximate="tanh" if approx in (b"tanh", "tanh") else "none")]


def _pad(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, pads = _tensor(ins[0]), _ints(ins[1])
    mode = a.get("mode", b"constant")
    if mode not in (b"constant", "constant") or (len(ins) > 3 and ins[3] is not None):
        raise UsageError(f"Pad mode {mode!r} with axes is not supported by the ONNX importer; only constant pads over all axes")
    value = float(np.asarray(ins[2]).reshape(-1)[0]) if len(ins) > 2 and ins[2] is not None else 0.0
    n = x.dim()
    fp: list[int] = []
    for d in reversed(range(n)):
        fp += [pads[d], pads[d + n]]
    return [F.pad(x, fp, value=value)]


def _flatten(x: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX Flatten: (d0 x ... x d[axis-1], d[axis] x ... x dn); axis may be -rank..rank (rank: all in the first)."""
    if axis < 0:
        axis += x.dim()
    if axis == 0:
        return x.reshape(1, -1)
    if axis >= x.dim():
        return x.reshape(-1, 1)
    return x.flatten(axis).flatten(0, axis - 1)


def _range(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    s, e, d = (np.asarray(v).reshape(-1)[0] if not isinstance(v, torch.Tensor) else v.item() for v in ins)
    sym = any(isinstance(v, torch.SymInt) for v in (s, e, d))
    if _host(*ins) and not sym:
        return [np.arange(s, e, d, dtype=np.asarray(ins[0]).dtype)]
    # a symbolic bound (a dynamic dim) must not reach np.arange, which would specialize it to its traced value
    like = _like(ins)
    device = like.device if like is not None else next((b.device for b in m.buffers()), torch.device("cpu"))
    return [torch.arange(s, e, d, device=device)]


def _variadic(np_fn: Callable, t_fn: Callable, mean: bool = False) -> Callable:
    """Max / Min / Sum / Mean: one or more inputs, broadcast, folded left to right."""
    pair = _binary(np_fn, t_fn)

    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        out = ins[0]
        for v in ins[1:]:
            out = pair(m, [out, v], a)[0]
        return [out / len(ins) if mean else out]
    return run


def _mod(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """fmod=0 (integers only): the result takes the divisor's sign (Python's %); fmod=1: the dividend's (C fmod)."""
    fmod = bool(a.get("fmod", 0))
    return _binary(np.fmod if fmod else np.mod, torch.fmod if fmod else torch.remainder)(m, ins, a)


def _cumsum(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x, axis = ins[0], int(_ints(ins[1])[0])
    rev, excl = bool(a.get("reverse", 0)), bool(a.get("exclusive", 0))
    if isinstance(x, np.ndarray):
        y = np.flip(x, axis) if rev else x
        c = np.cumsum(y, axis=axis, dtype=x.dtype)
        c = c - y if excl else c
        return [np.flip(c, axis) if rev else c]
    y = x.flip(axis) if rev else x
    c = torch.cumsum(y, dim=axis, dtype=x.dtype)  # torch would widen int32 to int64
    c = c - y if excl else c
    return [c.flip(axis) if rev else c]


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


def _lrn(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """LRN (AlexNet, GoogLeNet): x / (bias + alpha / size * sum of x^2 over channels c - floor((size - 1) / 2) ..
    c + ceil((size - 1) / 2)) ** beta. ``F.local_response_norm`` centres an even window one channel lower."""
    x, size = _tensor(ins[0]), int(a["size"])
    lo = (size - 1) // 2
    sq = F.pad((x * x).movedim(1, -1), (lo, size - 1 - lo))  # (N, ..., C + size - 1): channels last, zero-padded
    win = sq.unfold(-1, size, 1).sum(-1).movedim(-1, 1)  # (N, C, ...)
    return [x / (float(a.get("bias", 1.0)) + float(a.get("alpha", 1e-4)) / size * win) ** float(a.get("beta", 0.75))]


def _prelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """PRelu: the slope broadcasts against x (ONNX's unidirectional broadcast), unlike F.prelu's per-channel one."""
    x = _tensor(ins[0])
    return [torch.where(x >= 0, x, x * _tensor(ins[1], x))]


def _trilu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    k = int(_ints(ins[1])[0]) if len(ins) > 1 and ins[1] is not None else 0
    x = _tensor(ins[0])
    return [torch.triu(x, k) if a.get("upper", 1) else torch.tril(x, k)]


def _tile(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    reps = _ints(ins[1])
    if isinstance(ins[0], np.ndarray):
        return [np.tile(ins[0], reps)]
    return [_tensor(ins[0]).repeat(*reps)]


def _is_inf(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    pos, neg = a.get("detect_positive", 1), a.get("detect_negative", 1)
    if pos and neg:
        return [torch.isinf(x)]
    return [torch.isposinf(x) if pos else torch.isneginf(x) if neg else torch.zeros_like(x, dtype=torch.bool)]


def _bit_shift(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """BitShift on unsigned integers: ``direction`` LEFT or RIGHT, by the second input (broadcast); bits shifted
    past the type's width are dropped, as in ONNX Runtime."""
    d = a.get("direction")
    d = d.decode() if isinstance(d, bytes) else d
    if d not in ("LEFT", "RIGHT"):
        raise UsageError(f"BitShift direction={d!r} is not an ONNX direction; expected 'LEFT' or 'RIGHT'")
    left = d == "LEFT"
    if _host(*ins):
        return [(np.left_shift if left else np.right_shift)(*ins).astype(ins[0].dtype)]
    x, s = _tensor(ins[0]), _tensor(ins[1], _like(ins))
    if x.dtype == torch.uint8:
        return [(torch.bitwise_left_shift if left else torch.bitwise_right_shift)(x, s.to(x.dtype))]
    # torch shifts uint16/32/64 on no device: the bits go through int64, masked back to the type's width
    bits = x.element_size() * 8
    xi, si = (x.view(torch.int64) if bits == 64 else x.to(torch.int64)), s.to(torch.int64)
    y = xi << si if left else xi >> si
    if bits < 64:
        return [(y & ((1 << bits) - 1)).to(x.dtype)]
    if not left:  # int64's right shift copies the sign bit: clear the bits shifted in
        y = y & torch.where(si == 0, -1, (1 << (64 - si)) - 1)
    return [y.view(x.dtype)]


def _shrink(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Shrink: x + bias where x < -lambd, x - bias where x > lambd, 0 between (``F.hardshrink`` / ``softshrink``
    are its bias 0 / bias lambd forms); the output keeps x's type."""
    x = _tensor(ins[0])
    lambd, bias = float(a.get("lambd", 0.5)), float(a.get("bias", 0.0))
    y = torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))
    return [y.to(x.dtype)]


def _reverse_sequence(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """ReverseSequence(x, sequence_lens (B,)): the first ``sequence_lens[b]`` steps of each batch entry reversed
    along ``time_axis``, the rest kept (bidirectional RNNs over padded batches); one gather along the time axis."""
    x = _tensor(ins[0])
    lens = _tensor(ins[1], x).long()
    t_ax, b_ax = int(a.get("time_axis", 0)), int(a.get("batch_axis", 1))
    t = torch.arange(x.shape[t_ax], device=x.device)
    src = torch.where(t[None, :] < lens[:, None], lens[:, None] - 1 - t[None, :], t[None, :])  # (B, T)
    shape = [1] * x.dim()
    shape[b_ax], shape[t_ax] = x.shape[b_ax], x.shape[t_ax]
    src = src if b_ax < t_ax else src.t()  # (B, T) or (T, B), in x's axis order
    return [torch.gather(x, t_ax, src.reshape(shape).expand(x.shape))]


OPS: dict[str, Op] = {
    "BitShift": _bit_shift, "Shrink": _shrink, "ReverseSequence": _reverse_sequence,
    "Identity": lambda m, ins, a: [ins[0]],
    "Dropout": lambda m, ins, a: [ins[0]],
    "Relu": _unary(F.relu), "Sigmoid": _unary(torch.sigmoid), "Tanh": _unary(torch.tanh),
    "Erf": _unary(torch.erf), "Sqrt": _unary(torch.sqrt), "Exp": _unary(torch.exp), "Log": _unary(torch.log),
    "Neg": _unary(torch.neg), "Abs": _unary(torch.abs), "Reciprocal": _unary(torch.reciprocal),
    "Not": _unary(torch.logical_not), "Floor": _unary(torch.floor), "Ceil": _unary(torch.ceil),
    "HardSwish": _unary(F.hardswish), "Softplus": _unary(F.softplus),
    "LeakyRelu": lambda m, ins, a: [F.leaky_relu(_tensor(ins[0]), float(a.get("alpha", 0.01)))],
    "HardSigmoid": lambda m, ins, a: [torch.clamp(float(a.get("alpha", 0.2)) * _tensor(ins[0]) + float(a.get("beta", 0.5)), 0, 1)],
    "Add": _binary(np.add, torch.add), "Sub": _binary(np.subtract, torch.sub), "Mul": _binary(np.multiply, torch.mul),
    "Div": _binary(_div_np, _div_t), "Pow": _pow,
    "Equal": _binary(np.equal, torch.eq), "Less": _binary(np.less, torch.lt), "Greater": _binary(np.greater, torch.gt),
    "And": _binary(np.logical_and, torch.logical_and), "Or": _binary(np.logical_or, torch.logical_or),
    "Max": _variadic(np.maximum, torch.maximum), "Min": _variadic(np.minimum, torch.minimum),
    "Sum": _variadic(np.add, torch.add), "Mean": _variadic(np.add, torch.add, mean=True),
    "GreaterOrEqual": _binary(np.greater_equal, torch.ge), "LessOrEqual": _binary(np.less_equal, torch.le),
    "Xor": _binary(np.logical_xor, torch.logical_xor), "Mod": _mod,
    "IsNaN": _unary(torch.isnan), "IsInf": _is_inf, "Sign": _unary(torch.sign), "Round": _unary(torch.round),
    "Sin": _unary(torch.sin), "Cos": _unary(torch.cos),
    "Elu": lambda m, ins, a: [F.elu(_tensor(ins[0]), float(a.get("alpha", 1.0)))],
    "Selu": lambda m, ins, a: [float(a.get("gamma", 1.0507009873554805))
                               * F.elu(_tensor(ins[0]), float(a.get("alpha", 1.6732632423543772)))],
    "Mish": _unary(F.mish), "PRelu": _prelu, "LRN": _lrn, "Softsign": _unary(F.softsign),
    "Celu": lambda m, ins, a: [F.celu(_tensor(ins[0]), float(a.get("alpha", 1.0)))],
    "ThresholdedRelu": lambda m, ins, a: [F.threshold(_tensor(ins[0]), float(a.get("alpha", 1.0)), 0.0)],
    "CumSum": _cumsum, "Trilu": _trilu, "Tile": _tile,
    "ConvTranspose": _conv_transpose,
    "InstanceNormalization": _instance_norm, "GroupNormalization": _group_norm,
    "MatMul": lambda m, ins, a: [torch.matmul(*_gemm_dtype(_tensor(ins[0]), _tensor(ins[1], _like(ins))))],
    "Gemm": _gemm, "Conv": _conv, "BatchNormalization": _batchnorm, "LayerNormalization": _layernorm,
    "MaxPool": _pool("max"), "AveragePool": _pool("avg"),
    "GlobalAveragePool": lambda m, ins, a: [_tensor(ins[0]).mean(dim=tuple(range(2, ins[0].dim())), keepdim=True)],
    "GlobalMaxPool": lambda m, ins, a: [_tensor(ins[0]).amax(dim=tuple(range(2, ins[0].dim())), keepdim=True)],
    "Flatten": lambda m, ins, a: [_flatten(_tensor(ins[0]), int(a.get("axis", 1)))],
    "Reshape": _reshape, "Shape": _shape, "Gather": _gather, "Slice": _slice, "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze, "Concat": _concat, "Cast": _cast, "Where": _where, "Expand": _expand,
    "Transpose": lambda m, ins, a: [np.transpose(ins[0], a.get("perm")) if isinstance(ins[0], np.ndarray) else _tensor(ins[0]).permute(*(a.get("perm") or reversed(range(ins[0].dim()))))],
    "ConstantOfShape": _const_of_shape, "Range": _range, "Pad": _pad, "Clip": _clip, "Gelu": _gelu,
    "Softmax": _softmax(torch.softmax), "LogSoftmax": _softmax(torch.log_softmax),
}
HOST_INPUTS = {"Resize": (1, 2, 3)}  # inputs read as Python numbers (Resize's scales and sizes), by position
