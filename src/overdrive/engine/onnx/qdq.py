"""QuantizeLinear and DequantizeLinear for overdrive's ONNX importer: int8/uint8 with zero points and fp8
(e4m3fn, e5m2), per tensor or per axis. One-element host scales and zero points stay Python floats, so the
traced graph folds them; others become device tensors shaped for the axis. ``OPS`` maps the two operator names
to them; ``importer.py`` merges it with ``ops.OPS``.

Example:
    >>> import numpy as np, torch
    >>> _quantize(None, [torch.tensor([0.5, -1.0]), np.float32(0.5), np.int8(0)], {})[0].tolist()
    [1, -2]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from overdrive.engine.onnx.values import _DTYPES, Op, OpModule, Value, _host_scalar, _tensor


def _qparams(scale_v: Value, zp_v: Value, like: torch.Tensor, axis: int) -> tuple[Any, Any, torch.dtype]:
    """(scale, zero point, scale dtype) broadcastable against ``like``: Python floats for one-element host
    constants (see :func:`_host_scalar`), else tensors shaped for ``axis``; the zero point None when absent."""
    shape = [1] * like.dim()
    scale: Any = _host_scalar(scale_v)
    if scale is not None:
        dtype = torch.as_tensor(np.zeros((), np.asarray(scale_v).dtype)).dtype
    else:
        t = _tensor(scale_v)
        dtype = t.dtype
        if t.numel() > 1:
            shape[axis] = -1
        scale = t.to(like.device).float().reshape(shape)
    zp: Any = None
    if zp_v is not None:
        zp = _host_scalar(zp_v)
        if zp is None:
            zp = _tensor(zp_v).to(like.device).float().reshape(shape)
    return scale, zp, dtype


def _quantize(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    x = _tensor(ins[0])
    zp_v = ins[2] if len(ins) > 2 and ins[2] is not None else None
    qdt = _DTYPES[int(a["output_dtype"])] if a.get("output_dtype") else (_tensor(zp_v).dtype if zp_v is not None else torch.uint8)
    scale, zp, _ = _qparams(ins[1], zp_v, x, int(a.get("axis", 1)))
    if not isinstance(scale, float):
        scale = scale.to(x.dtype)
    if qdt in (torch.float8_e4m3fn, torch.float8_e5m2):
        lim = torch.finfo(qdt).max
        return [(x / scale).clamp(-lim, lim).to(qdt)]
    info = torch.iinfo(qdt)
    q = torch.round(x / scale)
    return [(q + zp if zp is not None and not (isinstance(zp, float) and zp == 0) else q).clamp(info.min, info.max).to(qdt)]


def _dequantize(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
    q = _tensor(ins[0])
    zp_v = ins[2] if len(ins) > 2 and ins[2] is not None else None
    scale, zp, dtype = _qparams(ins[1], zp_v, q, int(a.get("axis", 1)))
    x = q.float()
    if zp is not None and not (isinstance(zp, float) and zp == 0):
        x = x - zp
    return [(x * scale).to(dtype)]


OPS: dict[str, Op] = {"QuantizeLinear": _quantize, "DequantizeLinear": _dequantize}
