"""The integer ONNX operators of overdrive's importer (``OPS``), as ONNX Runtime's quantization tool writes them:
``MatMulInteger`` and ``ConvInteger`` (``quantize_dynamic``), ``DynamicQuantizeLinear`` (the activations' run-time
scale), ``QLinearMatMul`` and ``QLinearConv`` (``quantize_static`` in the QOperator format).

Integer products are accumulated exactly: the operands, less their zero points, are multiplied in float64, which
holds every int8 x int8 sum of fewer than 2**37 terms without rounding (torch has no int32 GEMM on the CPU), and
the int32 result is cast back. Requantization follows ONNX Runtime's CPU kernels step for step, so the integers
match it bit for bit: the multiplier ``a_scale * b_scale / y_scale`` in float32, the int32 accumulator (bias
added) converted to float32 and scaled, rounded half to even, offset by the zero point and saturated. Zero points
and scales are per tensor, or per row of ``a`` / column of ``b`` (MatMul), per output channel (Conv weights).

Example:
    >>> import numpy as np
    >>> OPS["MatMulInteger"](None, [torch.tensor([[130, 128]], dtype=torch.uint8),
    ...                             torch.tensor([[1], [-2]], dtype=torch.int8), np.uint8(128)], {})[0]
    tensor([[2]], dtype=torch.int32)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.layers import OPS as LAYER_OPS
from overdrive.engine.onnx.values import Op, OpModule, Value, _tensor


def _given(ins: list[Value], i: int) -> Value:
    return ins[i] if len(ins) > i and ins[i] is not None else None


def _along(v: Value, like: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    """A scale or zero point as a float tensor broadcastable against ``like``: one element as it is, a 1-D one
    of ``like.shape[dim]`` elements laid along ``dim``, one of ``like``'s rank (a batched MatMul's) as it is."""
    t = _tensor(v).to(like.device)
    if t.numel() == 1:
        return t.reshape(())
    if t.dim() == like.dim():
        return t
    d = dim % like.dim()
    if t.dim() != 1 or t.numel() != like.shape[d]:
        raise UsageError(f"{what} of shape {tuple(t.shape)} fits neither one value per tensor nor one per index of "
                         f"axis {d} of an input of shape {tuple(like.shape)} ({like.shape[d]} values); the model is "
                         "malformed: re-quantize it")
    shape = [1] * like.dim()
    shape[d] = -1
    return t.reshape(shape)


def _centered(x: torch.Tensor, zp: Value, dim: int, what: str) -> torch.Tensor:
    """x - zero point, in float64 (exact for 8-bit operands)."""
    xd = x.double()
    return xd if zp is None else xd - _along(zp, x, dim, what).double()


def _multiplier(scales: list[tuple[Value, torch.Tensor, int]], y_scale: Value) -> Any:
    """``s0 * s1 / y_scale`` in float32, left to right as ONNX Runtime computes it: a Python float when every scale
    is one host value (the traced graph folds it), else a float32 tensor. ``scales``: (value, like, dim) each."""
    if all(isinstance(v, np.ndarray) and v.size == 1 for v, _, _ in scales) and isinstance(y_scale, np.ndarray):
        m = np.float32(np.asarray(scales[0][0]).reshape(-1)[0])
        for v, _, _ in scales[1:]:
            m = np.float32(m * np.float32(np.asarray(v).reshape(-1)[0]))
        return float(np.float32(m / np.float32(np.asarray(y_scale).reshape(-1)[0])))
    m = _along(scales[0][0], scales[0][1], scales[0][2], "the scale").float()
    for v, like, dim in scales[1:]:
        m = m * _along(v, like, dim, "the scale").float()
    return m / _tensor(y_scale).to(m.device).float().reshape(())


def _qtype(zp: Value) -> torch.dtype:
    """The quantized type a zero point names: uint8 without one, as the spec defaults."""
    if zp is None:
        return torch.uint8
    return _tensor(zp).dtype


def requantize(acc: torch.Tensor, mult: Any, zp: Value, qdt: torch.dtype) -> torch.Tensor:
    """An exact accumulator (float64 holding integers) to ``qdt``: float32(acc) * mult, rounded half to even, plus
    the zero point, saturated to the type's range, as ONNX Runtime's MLAS requantizes."""
    y = torch.round(acc.float() * mult)
    if zp is not None:
        y = y + _tensor(zp).to(y.device).float().reshape(())
    info = torch.iinfo(qdt)
    return y.clamp(info.min, info.max).to(qdt)


def _int_matmul(a: torch.Tensor, a_zp: Value, b: torch.Tensor, b_zp: Value) -> torch.Tensor:
    """(A - a_zp) @ (B - b_zp), exact, as float64: a_zp per row of A (M), b_zp per column of B (N)."""
    if a.dim() < 2 or b.dim() < 2:
        raise UsageError(f"integer MatMul of shapes {tuple(a.shape)} and {tuple(b.shape)}: the importer takes operands "
                         "of rank 2 or more (a vector operand has no rows or columns for per-axis zero points)")
    return _centered(a, a_zp, -2, "a_zero_point") @ _centered(b, b_zp, -1, "b_zero_point")


def _int_conv(x: torch.Tensor, x_zp: Value, w: torch.Tensor, w_zp: Value, a: dict) -> torch.Tensor:
    """Conv(x - x_zp, w - w_zp), exact, as float64: padding holds x's zero point (zero once centered), as in ONNX
    Runtime; w_zp per output channel (axis 0 of W)."""
    if x_zp is not None and _tensor(x_zp).numel() > 1:
        raise UsageError(f"x_zero_point of {_tensor(x_zp).numel()} values: an integer Conv's input takes one zero "
                         "point per tensor; the model is malformed: re-quantize it")
    xc = _centered(x, x_zp, 1, "x_zero_point")
    wc = _centered(w, w_zp, 0, "w_zero_point")
    return LAYER_OPS["Conv"](None, [xc, wc], a)[0]


def _matmul_integer(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """MatMulInteger(A, B, a_zero_point?, b_zero_point?) -> int32."""
    x = _tensor(ins[0])
    return [_int_matmul(x, _given(ins, 2), _tensor(ins[1], x), _given(ins, 3)).to(torch.int32)]


def _conv_integer(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """ConvInteger(x, w, x_zero_point?, w_zero_point?) -> int32; Conv's attributes."""
    x = _tensor(ins[0])
    return [_int_conv(x, _given(ins, 2), _tensor(ins[1], x), _given(ins, 3), a).to(torch.int32)]


def _qlinear_matmul(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """QLinearMatMul(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) -> y of y_zp's type."""
    x = _tensor(ins[0])
    w = _tensor(ins[3], x)
    acc = _int_matmul(x, ins[2], w, ins[5])
    mult = _multiplier([(ins[1], x, -2), (ins[4], w, -1)], ins[6])
    if isinstance(mult, torch.Tensor) and mult.dim() == 1:  # a per-column (N,) multiplier
        mult = mult.reshape([1] * (acc.dim() - 1) + [-1])
    return [requantize(acc, mult, ins[7], _qtype(ins[7]))]


def _qlinear_conv(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """QLinearConv(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B?) -> y of y_zp's type; B int32 (scale
    x_scale * w_scale, zero point 0) is added to the accumulator."""
    x = _tensor(ins[0])
    w = _tensor(ins[3], x)
    acc = _int_conv(x, ins[2], w, ins[5], a)
    chan = [1, -1] + [1] * (acc.dim() - 2)  # (1, M, 1, ..): per output channel
    b = _given(ins, 8)
    if b is not None:
        acc = acc + _tensor(b, x).double().reshape(chan)
    mult = _multiplier([(ins[1], x, 1), (ins[4], w, 0)], ins[6])
    if isinstance(mult, torch.Tensor) and mult.dim():
        mult = mult.reshape(chan)
    return [requantize(acc, mult, ins[7], _qtype(ins[7]))]


def _dynamic_quantize_linear(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    """DynamicQuantizeLinear(x) -> (y uint8, y_scale, y_zero_point): the range [min(x, 0), max(x, 0)] mapped onto
    0..255; a range of zero width gets scale 1 (ONNX Runtime's choice; the spec divides by zero)."""
    x = _tensor(ins[0])
    if not x.is_floating_point():
        raise UsageError(f"DynamicQuantizeLinear of a {x.dtype} input; expected float32 (the spec's only input type)")
    xf = x.float()
    lo, hi = xf.min().clamp(max=0.0), xf.max().clamp(min=0.0)
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
    zp = torch.round((0.0 - lo / scale).clamp(0.0, 255.0))
    y = (torch.round(xf / scale) + zp).clamp(0, 255).to(torch.uint8)
    return [y, scale, zp.to(torch.uint8)]


OPS: dict[str, Op] = {
    "MatMulInteger": _matmul_integer, "ConvInteger": _conv_integer, "QLinearMatMul": _qlinear_matmul,
    "QLinearConv": _qlinear_conv, "DynamicQuantizeLinear": _dynamic_quantize_linear,
}
