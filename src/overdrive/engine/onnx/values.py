"""Values in overdrive's ONNX importer: device tensors, or numpy arrays for host constants and shapes (object
arrays of SymInts under dynamic export), and the conversions between them. Also the types the operators are
written against (:class:`OpModule`, :data:`Op`), so the operator modules need nothing from ``importer.py``, and
the helpers more than one of them uses (:func:`_gemm_dtype`, :func:`_flatten`).

Example:
    >>> _ints(np.array([1, 2]))
    [1, 2]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

Value = Any  # torch.Tensor (device data) or np.ndarray (host constants / shapes)


class OpModule(Protocol):
    """What an operator reads from the module running it (``importer.ONNXModule``): structural, so the operator
    modules, which ``importer.py`` imports, never import it back."""

    opset: int  # the default-domain opset: a few ops (Softmax before 13) changed meaning between opsets

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]: ...


# one ONNX operator: (module, input values, node attributes) -> output values
Op = Callable[[OpModule, list[Value], dict], list[Value]]

_DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
           9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16, 17: torch.float8_e4m3fn,
           19: torch.float8_e5m2}
_NP = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_,
       torch.float16: np.float16, torch.float64: np.float64, torch.int8: np.int8, torch.uint8: np.uint8}


# dtypes numpy lacks: onnx hands them over as ml_dtypes arrays, which torch.from_numpy refuses; reinterpreted
# through the unsigned integer of the same width
_ML_DTYPES = {"bfloat16": (np.uint16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
              "float8_e5m2": (np.uint8, torch.float8_e5m2)}


# 4-bit integers (opset 21) have no torch dtype: they travel as int8 / uint8 holding the same values (ml_dtypes
# keeps one per byte in the low nibble, so they are converted, not reinterpreted); QuantizeLinear clamps to 4 bits
FOUR_BIT = {"int4": (np.int8, -8, 7), "uint4": (np.uint8, 0, 15)}


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    """A tensor holding a copy of ``arr``, ml_dtypes' bfloat16 and float8 arrays included, and int4 / uint4 as
    int8 / uint8 of the same values. Other dtypes torch lacks (float8 ``fnuz``, float4, int2) raise ``TypeError``
    naming the dtype.

    Example:
        >>> import ml_dtypes
        >>> _from_numpy(np.array([-8, 7], dtype=ml_dtypes.int4)).tolist()
        [-8, 7]
    """
    arr = np.array(arr, copy=True)
    if arr.dtype.name in _ML_DTYPES:
        bits, dtype = _ML_DTYPES[arr.dtype.name]
        return torch.from_numpy(arr.view(bits)).view(dtype)
    if arr.dtype.name in FOUR_BIT:
        return torch.from_numpy(arr.astype(FOUR_BIT[arr.dtype.name][0]))
    if arr.dtype.kind == "V":  # another ml_dtypes type: torch.from_numpy's own error names none of them
        raise TypeError(f"ONNX element type {arr.dtype.name} has no PyTorch dtype in overdrive's importer")
    return torch.from_numpy(arr)


def _tensor(v: Value, like: torch.Tensor | None = None) -> torch.Tensor:
    """``v`` as a tensor; with ``like``, on its device (and in its float dtype where both are floating)."""
    if isinstance(v, torch.Tensor):
        if like is not None and v.device != like.device:  # a tensor computed from host constants
            v = v.to(like.device)
        return v
    arr = np.asarray(v)
    if arr.dtype == object:  # symbolic sizes: build the tensor element by element
        t = torch.stack([torch.as_tensor(x) if not isinstance(x, torch.SymInt) else torch.sym_int(x) * torch.ones((), dtype=torch.int64) for x in arr.reshape(-1)])
        t = t.reshape(arr.shape)
    else:
        t = _from_numpy(arr)
    if like is not None:
        t = t.to(like.device)
        if t.is_floating_point() and like.is_floating_point():
            t = t.to(like.dtype)
    return t


def _as_value(r: Any) -> Value:
    """numpy scalars and bare (Sym)ints from host ops -> 0-d arrays, so every value is a tensor or an array."""
    if r is None or isinstance(r, (torch.Tensor, np.ndarray)):
        return r
    return np.array(r, dtype=object if isinstance(r, torch.SymInt) else None)


def _ints(v: Value) -> list[Any]:
    if isinstance(v, torch.Tensor):
        return [int(x) for x in v.reshape(-1).tolist()]
    return [x if isinstance(x, torch.SymInt) else int(x) for x in np.asarray(v).reshape(-1)]


def _host(*vals: Value) -> bool:
    return all(isinstance(v, np.ndarray) for v in vals)


def _like(vals: list[Value]) -> torch.Tensor | None:
    return next((v for v in vals if isinstance(v, torch.Tensor)), None)


def _gemm_dtype(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The operands of a matrix product (MatMul, Gemm, Conv) in one float dtype. A half build casts the model's
    weights and inputs to fp16/bf16 but keeps the graph's own ``Cast(to=FLOAT)`` (a mask or a softmax the model
    computes in fp32), so an fp32 activation can meet an fp16 operand there: the product runs in the half dtype, as
    a TensorRT fp16 engine runs its GEMMs, and as autocast does. A graph that mixes no dtypes is left as it is.

    Example:
        >>> [t.dtype for t in _gemm_dtype(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float16))]
        [torch.float16, torch.float16]
    """
    floats = {t.dtype for t in ts if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(floats) < 2:
        return list(ts)
    half = [d for d in (torch.float16, torch.bfloat16) if d in floats]
    to = half[0] if half else max(floats, key=lambda d: torch.finfo(d).bits)
    return [t.to(to) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in ts]


def _host_scalar(v: Value) -> float | None:
    """A one-element host constant (a Q/DQ scale or zero point stored as an initializer) as a Python float,
    so the traced graph holds a scalar literal: Inductor fails to lower a reshape of a 0-d tensor constant."""
    if isinstance(v, np.ndarray) and v.size == 1 and v.dtype != object:
        return float(v.reshape(-1)[0])
    return None


def _floats(v: Value) -> list[float]:
    if isinstance(v, torch.Tensor):
        return [float(x) for x in v.reshape(-1).tolist()]
    return [float(x) for x in np.asarray(v).reshape(-1)]


def _flatten(x: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX Flatten: (d0 x ... x d[axis-1], d[axis] x ... x dn); axis may be -rank..rank (rank: all in the first)."""
    if axis < 0:
        axis += x.dim()
    if axis == 0:
        return x.reshape(1, -1)
    if axis >= x.dim():
        return x.reshape(-1, 1)
    return x.flatten(axis).flatten(0, axis - 1)
