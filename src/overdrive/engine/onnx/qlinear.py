"""ONNX Runtime's quantized com.microsoft operators that its quantization tool writes (``quantize_static`` in the
QOperator format) around the standard QLinearConv / QLinearMatMul, for overdrive's importer (``OPS``, merged into
``contrib.OPS``): ``QLinearAdd``, ``QLinearMul``, ``QLinearSigmoid``, ``QLinearLeakyRelu``, ``QLinearSoftmax``,
``QLinearGlobalAveragePool``, ``QLinearConcat``, ``QGemm`` and ``QLinearAveragePool``.

Each follows ONNX Runtime's CPU kernel: ``QGemm`` and ``QLinearGlobalAveragePool`` accumulate exactly and
requantize as ``integer.requantize`` does (bit for bit); ``QLinearAveragePool`` sums each window's dequantized values
in float32 in the kernel's order, so it matches bit for bit too; the elementwise ones compute in float32 what ONNX
Runtime's kernels compute (dequantize ``scale * (q - zero_point)``, the function, ``round(v / y_scale) +
y_zero_point`` half to even, saturated), so they match it bit for bit but where ONNX Runtime's fused multiply-adds,
its approximate exp / logistic or its integer softmax round a value that lies on a rounding edge the other way:
those differ by one quantization step.

Example:
    >>> import numpy as np
    >>> q = torch.tensor([0, 10, 20], dtype=torch.uint8)
    >>> OPS["QLinearAdd"](None, [q, np.float32(0.1), np.uint8(0), q, np.float32(0.1), np.uint8(0),
    ...                          np.float32(0.2), np.uint8(0)], {})[0]
    tensor([ 0, 10, 20], dtype=torch.uint8)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.integer import _along, _centered, _given, _multiplier, _qtype, requantize
from overdrive.engine.onnx.values import Op, OpModule, Value, _tensor

# op -> (fewest inputs, most inputs, the inputs' names): checked when the model is imported
ARITY: dict[str, tuple[int, int, str]] = {
    "QLinearAdd": (7, 8, "A, A_scale, A_zero_point?, B, B_scale, B_zero_point?, C_scale, C_zero_point?"),
    "QLinearMul": (7, 8, "A, A_scale, A_zero_point?, B, B_scale, B_zero_point?, C_scale, C_zero_point?"),
    "QLinearSigmoid": (4, 5, "X, X_scale, X_zero_point?, Y_scale, Y_zero_point?"),
    "QLinearLeakyRelu": (4, 5, "X, X_scale, X_zero_point?, Y_scale, Y_zero_point?"),
    "QLinearSoftmax": (4, 5, "X, X_scale, X_zero_point?, Y_scale, Y_zero_point?"),
    "QLinearGlobalAveragePool": (4, 5, "X, x_scale, x_zero_point?, y_scale, y_zero_point?"),
    "QLinearConcat": (5, 1 << 30, "Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per input"),
    "QGemm": (6, 9, "A, a_scale, a_zero_point, B, b_scale, b_zero_point, C?, y_scale?, y_zero_point?"),
    "QLinearAveragePool": (4, 5, "X, x_scale, x_zero_point?, y_scale, y_zero_point?"),
}


def _f32(v: Value, like: torch.Tensor) -> torch.Tensor:
    """A scale or zero point as a float32 tensor on ``like``'s device (one element, or shaped to broadcast)."""
    t = _tensor(v).to(like.device).float()
    return t.reshape(()) if t.numel() == 1 else t


def _dequant(q: torch.Tensor, scale: Value, zp: Value) -> torch.Tensor:
    """scale * (q - zero_point) in float32, as ONNX Runtime dequantizes into its lookup tables."""
    x = q.float() if zp is None else q.float() - _f32(zp, q)
    return _f32(scale, q) * x


def _quant(x: torch.Tensor, scale: Value, zp: Value) -> torch.Tensor:
    """round(x / scale) + zero_point, saturated, in the zero point's type (uint8 without one)."""
    qdt = _qtype(zp)
    y = torch.round(x / _f32(scale, x))
    if zp is not None:
        y = y + _f32(zp, x)
    info = torch.iinfo(qdt)
    return y.clamp(info.min, info.max).to(qdt)


def _binary(mul: bool) -> Op:
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        qa = _tensor(ins[0])
        qb = _tensor(ins[3], qa)
        sa, sb, sc = (_f32(ins[i], qa) for i in (1, 4, 6))
        za, zb = (_f32(ins[i], qa) if _given(ins, i) is not None else 0.0 for i in (2, 5))
        zc = _given(ins, 7)
        fc = _f32(zc, qa) if zc is not None else 0.0
        fa, fb = qa.float(), qb.float()
        if mul:  # (a - za)(b - zb) * (sa * sb / sc) + zc: the integer product is exact in float32
            v = (fa - za) * (fb - zb) * (sa * sb / sc) + fc
        else:  # b * (sb / sc) + (a * (sa / sc) + the fixed part): ONNX Runtime's terms, in its order
            r_ac, r_bc = sa / sc, sb / sc
            fixed = fc - (r_ac * za + r_bc * zb)
            v = fb * r_bc + (fa * r_ac + fixed)
        qdt = _qtype(zc)
        info = torch.iinfo(qdt)
        return [torch.round(v).clamp(info.min, info.max).to(qdt)]
    return run


def _lookup(fn: Any) -> Op:
    """An elementwise op ONNX Runtime runs from a 256-entry table: quantize(fn(dequantize(x)))."""
    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        x = _tensor(ins[0])
        return [_quant(fn(_dequant(x, ins[1], _given(ins, 2)), a), ins[3], _given(ins, 4))]
    return run


def _softmax(x: torch.Tensor, a: dict) -> torch.Tensor:
    """Softmax over ``axis``; before opset 13 (the node's ``opset`` attribute) over the input flattened from it."""
    opset = int(a.get("opset", 13))
    axis = int(a.get("axis", -1 if opset >= 13 else 1)) % max(x.dim(), 1)
    if opset >= 13:
        return torch.softmax(x, axis)
    return torch.softmax(x.flatten(axis), -1).reshape(x.shape) if axis < x.dim() - 1 else torch.softmax(x, -1)


def _global_avg_pool(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Sum of (x - zero_point) over the spatial axes, exact, times x_scale / (y_scale * count), requantized;
    ``channels_last`` 1 reads (N, H, W, C)."""
    x = _tensor(ins[0])
    last = bool(a.get("channels_last", 0))
    dims = tuple(range(1, x.dim() - 1)) if last else tuple(range(2, x.dim()))
    count = int(np.prod([x.shape[d] for d in dims]))
    acc = _centered(x, _given(ins, 2), 0, "x_zero_point").sum(dims, keepdim=True)
    mult = _f32(ins[1], x) / (_f32(ins[3], x) * np.float32(count))
    zp = _given(ins, 4)
    return [requantize(acc, mult, zp, _qtype(zp))]


def _concat(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """Each input requantized to (Y_scale, Y_zero_point) where its own differ, then concatenated along ``axis``."""
    if (len(ins) - 2) % 3:
        raise UsageError(f"QLinearConcat with {len(ins)} inputs; expected Y_scale, Y_zero_point and then three per "
                         "input (X, X_scale, X_zero_point); the model is malformed: re-quantize it")
    parts = []
    for k in range(2, len(ins), 3):
        q = _tensor(ins[k])
        parts.append(_quant(_dequant(q, ins[k + 1], ins[k + 2]), ins[0], ins[1]))
    like = parts[0]
    return [torch.cat([p.to(like.device) for p in parts], int(a["axis"]))]


def _qgemm(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """QGemm: alpha * (A' - a_zp) @ (B' - b_zp) + C (int32, scale alpha * a_scale * b_scale), A' / B' transposed
    by transA / transB; quantized to (y_scale, y_zero_point), or float32 without y_scale."""
    qa = _tensor(ins[0])
    qb = _tensor(ins[3], qa)
    if a.get("transA", 0):
        qa = qa.t()
    if a.get("transB", 0):
        qb = qb.t()
    b_zp = ins[5]
    if b_zp is not None and a.get("transB", 0) and _tensor(b_zp).dim() == 2:
        b_zp = _tensor(b_zp).t()
    acc = _centered(qa, ins[2], -2, "a_zero_point") @ _centered(qb, b_zp, -1, "b_zero_point")
    c = _given(ins, 6)
    if c is not None:
        acc = acc + _tensor(c, qa).double()
    alpha = np.array(np.float32(a.get("alpha", 1.0)))
    y_scale = _given(ins, 7)
    scales = [(alpha, qa, -2), (ins[1], qa, -2), (ins[4], qb, -1)]
    mult = _multiplier(scales, y_scale if y_scale is not None else np.array(np.float32(1.0)))
    if isinstance(mult, torch.Tensor) and mult.dim() == 1:
        mult = mult.reshape(1, -1)
    if y_scale is None:
        return [acc.float() * mult]
    return [requantize(acc, mult, _given(ins, 8), _qtype(_given(ins, 8)))]


def _average_pool(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """QLinearAveragePool as ONNX Runtime's CPU kernel computes it: each window's dequantized values summed in float32
    in the kernel's order (row by row), divided by the count (the whole kernel with ``count_include_pad``, else the
    elements inside the input), then ``round(y / y_scale + y_zero_point)``, saturated. AveragePool's attributes;
    ``channels_last`` 1 reads (N, spatial.., C)."""
    x = _tensor(ins[0])
    last = bool(a.get("channels_last", 0))
    if last:
        x = x.movedim(-1, 1)
    k = [int(v) for v in a["kernel_shape"]]
    n = len(k)
    if x.dim() != n + 2:
        raise UsageError(f"QLinearAveragePool kernel_shape {k} on an input of shape {tuple(x.shape)}; expected a "
                         f"rank-{n + 2} input")
    if any(d != 1 for d in a.get("dilations", [1] * n)):
        raise UsageError(f"QLinearAveragePool dilations={list(a['dilations'])} are not supported; expected 1s")
    strides = [int(v) for v in a.get("strides", [1] * n)]
    spatial = list(x.shape[2:])
    ap = a.get("auto_pad", "NOTSET")
    ap = ap.decode() if isinstance(ap, bytes) else str(ap)
    if ap in ("NOTSET", "VALID"):
        pads = [0] * (2 * n) if ap == "VALID" else [int(v) for v in a.get("pads", [0] * (2 * n))]
        ceil = bool(a.get("ceil_mode", 0))
        out = [((i + pads[d] + pads[d + n] - k[d]) + (s - 1 if ceil else 0)) // s + 1
               for d, (i, s) in enumerate(zip(spatial, strides))]
    elif ap in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-i // s) for i, s in zip(spatial, strides)]
        need = [max((o - 1) * s + kk - i, 0) for o, s, kk, i in zip(out, strides, k, spatial)]
        small = [t // 2 for t in need]  # SAME_UPPER pads the odd element at the end, SAME_LOWER at the start
        pads = ([t - h for t, h in zip(need, small)] if ap == "SAME_LOWER" else small) + [0] * n
    else:
        raise UsageError(f"QLinearAveragePool auto_pad={ap!r}; expected NOTSET, VALID, SAME_UPPER or SAME_LOWER")
    xf = _dequant(x, ins[1], _given(ins, 2))  # (N, C, spatial..) float32
    inside = torch.ones_like(xf[:1, :1])
    # pad to cover every window: pads[d] before, whatever the last window needs after (zeros add nothing)
    after = [max((o - 1) * s + kk - pads[d] - i, 0) for d, (o, s, kk, i) in enumerate(zip(out, strides, k, spatial))]
    fpad = [p for d in reversed(range(n)) for p in (pads[d], after[d])]
    xf, inside = torch.nn.functional.pad(xf, fpad), torch.nn.functional.pad(inside, fpad)
    total = count = None
    for offs in np.ndindex(*k):  # the kernel's order: outer axis first, each window's sum in float32
        idx = (slice(None), slice(None)) + tuple(slice(o, o + (q - 1) * s + 1, s)
                                                 for o, q, s in zip(offs, out, strides))
        total = xf[idx] if total is None else total + xf[idx]
        count = inside[idx] if count is None else count + inside[idx]
    y = total / (float(np.prod(k)) if int(a.get("count_include_pad", 0)) else count)
    zp = _given(ins, 4)
    qdt = _qtype(zp)
    y = y / _f32(ins[3], y)
    if zp is not None:
        y = y + _f32(zp, y)
    info = torch.iinfo(qdt)
    y = torch.round(y).clamp(info.min, info.max).to(qdt)
    return [y.movedim(1, -1) if last else y]


def _leaky(x: torch.Tensor, a: dict) -> torch.Tensor:
    return torch.where(x >= 0, x, x * float(a.get("alpha", 0.01)))


OPS: dict[str, Op] = {
    "QLinearAdd": _binary(False), "QLinearMul": _binary(True),
    "QLinearSigmoid": _lookup(lambda x, a: torch.sigmoid(x)), "QLinearLeakyRelu": _lookup(_leaky),
    "QLinearSoftmax": _lookup(_softmax), "QLinearGlobalAveragePool": _global_avg_pool, "QLinearConcat": _concat,
    "QGemm": _qgemm, "QLinearAveragePool": _average_pool,
}
