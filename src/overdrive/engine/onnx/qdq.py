"""QuantizeLinear and DequantizeLinear for overdrive's ONNX importer: int8/uint8, int16/uint16 and int4/uint4 with
zero points, and fp8 (e4m3fn, e5m2), per tensor, per axis, or per block (opset 21's ``block_size``). One-element
host scales and zero points stay Python floats, so the traced graph folds them; others become device tensors shaped
for the axis (a block's scale repeated over its block). 4-bit values travel as int8 / uint8 (``values.FOUR_BIT``).
``OPS`` maps the two operator names to them; ``importer.py`` merges it with ``ops.OPS``.

Example:
    >>> import numpy as np, torch
    >>> _quantize(None, [torch.tensor([0.5, -1.0]), np.float32(0.5), np.int8(0)], {})[0].tolist()
    [1, -2]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import _DTYPES, FOUR_BIT, Op, OpModule, Value, _host_scalar, _tensor

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_4BIT_CODES = {22: "int4", 21: "uint4"}  # TensorProto.INT4, UINT4


def _per_axis(t: torch.Tensor, like: torch.Tensor, axis: int, block: int, what: str) -> torch.Tensor:
    """A scale or zero point of more than one element, broadcastable against ``like``: a 1-D one along ``axis``,
    or with ``block`` > 0 one of ``like``'s rank whose ``axis`` dim counts blocks, each repeated over its block."""
    ax = axis % like.dim() if like.dim() else 0
    if block > 0:
        n = like.shape[ax]
        blocks = -(-n // block) if isinstance(n, int) else None
        if t.dim() != like.dim() or (blocks is not None and t.shape[ax] != blocks):
            raise UsageError(f"{what} of shape {tuple(t.shape)} does not fit block_size={block} along axis {axis} of an "
                             f"input of shape {tuple(like.shape)} (expected {blocks} blocks on that axis)")
        return t.repeat_interleave(block, dim=ax).narrow(ax, 0, n)
    n = like.shape[ax] if like.dim() else 1
    if t.dim() != 1 or (isinstance(n, int) and t.numel() != n):
        raise UsageError(f"{what} of shape {tuple(t.shape)} does not fit axis {axis} of an input of shape "
                         f"{tuple(like.shape)}: per-axis quantization takes one value per index of that axis")
    shape = [1] * like.dim()
    shape[ax] = -1
    return t.reshape(shape)


def _qparams(scale_v: Value, zp_v: Value, like: torch.Tensor, a: dict) -> tuple[Any, Any, torch.dtype]:
    """(scale, zero point, scale dtype) broadcastable against ``like``: Python floats for one-element host
    constants (see :func:`_host_scalar`), else tensors shaped for the node's ``axis`` (and ``block_size``); the
    zero point None when absent."""
    axis, block = int(a.get("axis", 1)), int(a.get("block_size", 0))
    scale: Any = _host_scalar(scale_v) if block == 0 else None
    if scale is not None:
        dtype = torch.as_tensor(np.zeros((), np.asarray(scale_v).dtype)).dtype
    else:
        t = _tensor(scale_v)
        dtype = t.dtype
        scale = t.to(like.device).float()
        if t.numel() > 1 or block > 0:
            scale = _per_axis(scale, like, axis, block, "the scale")
    zp: Any = None
    if zp_v is not None:
        zp = _host_scalar(zp_v) if block == 0 else None
        if zp is None:
            z = _tensor(zp_v).to(like.device).float()
            zp = _per_axis(z, like, axis, block, "the zero point") if z.numel() > 1 or block > 0 else z
    return scale, zp, dtype


def _qtype(zp_v: Value, a: dict) -> tuple[torch.dtype, str]:
    """The quantized type of a QuantizeLinear: its torch dtype (int8 / uint8 for 4-bit) and its ONNX name. From
    ``output_dtype`` (opset 21), else the zero point's type, else uint8 (the spec's default)."""
    code = int(a.get("output_dtype", 0))
    if code in _4BIT_CODES:
        name = _4BIT_CODES[code]
        return torch.from_numpy(np.zeros(0, FOUR_BIT[name][0])).dtype, name
    if code:
        if code not in _DTYPES:
            raise UsageError(f"QuantizeLinear output_dtype={code} is not supported by overdrive's importer (int8, uint8, "
                             "int16, uint16, int4, uint4, float8 e4m3fn / e5m2 are)")
        return _DTYPES[code], str(_DTYPES[code]).removeprefix("torch.")
    if zp_v is None:
        return torch.uint8, "uint8"
    name = np.asarray(zp_v).dtype.name if not isinstance(zp_v, torch.Tensor) else ""
    if name in FOUR_BIT:
        return torch.from_numpy(np.zeros(0, FOUR_BIT[name][0])).dtype, name
    dt = _tensor(zp_v).dtype
    return dt, str(dt).removeprefix("torch.")


def _quantize(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    zp_v = ins[2] if len(ins) > 2 and ins[2] is not None else None
    qdt, name = _qtype(zp_v, a)
    scale, zp, _ = _qparams(ins[1], zp_v, x, a)
    if not isinstance(scale, float):
        scale = scale.to(x.dtype)
    if qdt in _FP8:
        if int(a.get("saturate", 1)) == 0:  # out of range -> NaN (e4m3fn, which has no inf) / inf (e5m2)
            y = x / scale
            if qdt == torch.float8_e4m3fn:  # torch's cast saturates to 448; past 464 (halfway to 480) rounds out
                y = torch.where(y.abs() > 464, torch.full_like(y, float("nan")), y)
            return [y.to(qdt)]
        lim = torch.finfo(qdt).max
        return [(x / scale).clamp(-lim, lim).to(qdt)]
    lo, hi = FOUR_BIT[name][1:] if name in FOUR_BIT else (torch.iinfo(qdt).min, torch.iinfo(qdt).max)
    q = torch.round(x / scale)  # half to even, as the spec's rounding
    return [(q + zp if zp is not None and not (isinstance(zp, float) and zp == 0) else q).clamp(lo, hi).to(qdt)]


def _dequantize(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    q = _tensor(ins[0])
    zp_v = ins[2] if len(ins) > 2 and ins[2] is not None else None
    scale, zp, dtype = _qparams(ins[1], zp_v, q, a)
    x = q.float()
    if zp is not None and not (isinstance(zp, float) and zp == 0):
        x = x - zp
    return [(x * scale).to(dtype)]


OPS: dict[str, Op] = {"QuantizeLinear": _quantize, "DequantizeLinear": _dequantize}
