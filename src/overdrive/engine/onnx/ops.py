"""The elementwise and math ONNX operators of overdrive's importer (``OPS``): activations, arithmetic and
comparisons with numpy broadcasting, the variadic Max / Min / Sum / Mean, Clip, Where, CumSum, BitShift. Each takes
the module, the input values and the node's attributes and returns the output values; host operands (shape
arithmetic, numpy) stay on the host, device data goes through torch functions that ``torch.export`` traces.
Shape and tensor manipulation is in ``shape.py``, the layers (Conv, Gemm, pools, norms, Softmax) in
``layers.py``; ``importer.py`` merges the tables.

Example:
    >>> "Add" in OPS and "Conv" not in OPS and "Reshape" not in OPS
    True
    >>> OPS["Div"](None, [np.array([-7]), np.array([2])], {})[0]
    array([-3])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import Op, OpModule, Value, _as_value, _host, _ints, _like, _tensor


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


def _clip(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    lo = ins[1] if len(ins) > 1 and ins[1] is not None else a.get("min")
    hi = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("max")
    x = _tensor(ins[0])
    if lo is None and hi is None:  # both bounds optional: no clipping (torch.clamp refuses two Nones)
        return [x]
    # integer tensors take integer bounds: float ones promoted int64 ids to float32 (2**24 + 1 came out 2**24);
    # a host bound (0-d, or the 1-element [v] some exporters write) is a number, a run-time one a tensor of x's dtype
    num = float if x.is_floating_point() else int
    f = (lambda v: None if v is None else num(np.asarray(v).reshape(-1)[0]) if not isinstance(v, torch.Tensor)
         else v.reshape(()).to(x.dtype))
    return [x.clamp(f(lo), f(hi))]


def _where(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    if _host(*ins):
        return [np.where(*ins)]
    like = _like(ins)
    c, x, y = (_tensor(v, like) for v in ins)
    return [torch.where(c.bool(), x, y)]


def _gelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    approx = a.get("approximate", b"none")
    return [F.gelu(_tensor(ins[0]), approximate="tanh" if approx in (b"tanh", "tanh") else "none")]


def _prelu(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """PRelu: the slope broadcasts against x (ONNX's unidirectional broadcast), unlike F.prelu's per-channel one."""
    x = _tensor(ins[0])
    return [torch.where(x >= 0, x, x * _tensor(ins[1], x))]


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


OPS: dict[str, Op] = {
    "Relu": _unary(F.relu), "Sigmoid": _unary(torch.sigmoid), "Tanh": _unary(torch.tanh), "Erf": _unary(torch.erf),
    "Sqrt": _unary(torch.sqrt), "Exp": _unary(torch.exp), "Log": _unary(torch.log), "Neg": _unary(torch.neg),
    "Abs": _unary(torch.abs), "Reciprocal": _unary(torch.reciprocal), "Not": _unary(torch.logical_not),
    "Floor": _unary(torch.floor), "Ceil": _unary(torch.ceil), "Sign": _unary(torch.sign),
    "Round": _unary(torch.round), "Sin": _unary(torch.sin), "Cos": _unary(torch.cos), "IsNaN": _unary(torch.isnan),
    "IsInf": _is_inf, "HardSwish": _unary(F.hardswish), "Softplus": _unary(F.softplus),
    "LeakyRelu": lambda m, ins, a: [F.leaky_relu(_tensor(ins[0]), float(a.get("alpha", 0.01)))],
    "HardSigmoid": lambda m, ins, a: [torch.clamp(float(a.get("alpha", 0.2)) * _tensor(ins[0]) + float(a.get("beta", 0.5)), 0, 1)],
    "Elu": lambda m, ins, a: [F.elu(_tensor(ins[0]), float(a.get("alpha", 1.0)))],
    "Selu": lambda m, ins, a: [float(a.get("gamma", 1.0507009873554805))
                               * F.elu(_tensor(ins[0]), float(a.get("alpha", 1.6732632423543772)))],
    "Mish": _unary(F.mish), "Softsign": _unary(F.softsign),
    "Celu": lambda m, ins, a: [F.celu(_tensor(ins[0]), float(a.get("alpha", 1.0)))],
    "ThresholdedRelu": lambda m, ins, a: [F.threshold(_tensor(ins[0]), float(a.get("alpha", 1.0)), 0.0)],
    "PRelu": _prelu, "Gelu": _gelu, "Shrink": _shrink, "Add": _binary(np.add, torch.add),
    "Sub": _binary(np.subtract, torch.sub), "Mul": _binary(np.multiply, torch.mul), "Div": _binary(_div_np, _div_t),
    "Pow": _pow, "Mod": _mod, "BitShift": _bit_shift, "Equal": _binary(np.equal, torch.eq),
    "Less": _binary(np.less, torch.lt), "Greater": _binary(np.greater, torch.gt),
    "GreaterOrEqual": _binary(np.greater_equal, torch.ge), "LessOrEqual": _binary(np.less_equal, torch.le),
    "And": _binary(np.logical_and, torch.logical_and), "Or": _binary(np.logical_or, torch.logical_or),
    "Xor": _binary(np.logical_xor, torch.logical_xor), "Max": _variadic(np.maximum, torch.maximum),
    "Min": _variadic(np.minimum, torch.minimum), "Sum": _variadic(np.add, torch.add),
    "Mean": _variadic(np.add, torch.add, mean=True), "Clip": _clip, "Where": _where, "CumSum": _cumsum,
}
HOST_INPUTS = {"Resize": (1, 2, 3)}  # inputs read as Python numbers (Resize's scales and sizes), by position
