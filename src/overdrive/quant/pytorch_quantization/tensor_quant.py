"""pytorch-quantization's ``tensor_quant``: ``QuantDescriptor`` and the fake-quant functions, over
overdrive.quant's TensorQuantizer (the same int8 arithmetic and clipped straight-through gradient).

Example:
    >>> import torch
    >>> fake_tensor_quant(torch.tensor([0.5, -3.0]), torch.tensor(2.0)).tolist()  # scale 2/127, clipped at 2
    [0.5039370059967041, -2.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant.config import QuantizerConfig
from overdrive.quant.quantizer import TensorQuantizer


class _Axis(int):
    """A one-axis ``axis`` given as an int, as pytorch-quantization's per-channel descriptors write it
    (``QuantDescriptor(axis=(0))``, which is the int 0): still the int (``axis == 0``, indexing, saving), and also
    read the way scripts written for a ``(0,)`` descriptor read it: ``axis == (0,)``, ``axis[0]``, ``set(axis)``,
    ``len(axis)``. Its hash is the int's.

    Example:
        >>> a = _Axis(0)
        >>> a == 0, a == (0,), a[0], list(a), a != (1,)
        (True, True, 0, [0], True)
    """

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, list)):
            return len(other) == 1 and int(self) == other[0]
        return int.__eq__(self, other)  # type: ignore[no-any-return]

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = int.__hash__

    def __iter__(self):  # noqa: ANN204
        return iter((int(self),))

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        return (int(self),)[i]

    def __repr__(self) -> str:
        return f"({int(self)},)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self) if not spec else int.__format__(self, spec)


@dataclass(frozen=True)
class QuantDescriptor:
    """How a pytorch-quantization quantizer quantizes: 8 bits, ``axis`` None (per tensor) or ``(0,)`` / ``0``
    (per channel; given back as given, a tuple or an int that also compares equal to ``(0,)``), ``calib_method`` "max" or "histogram" (then any of max / percentile / entropy / mse in
    ``load_calib_amax``), ``narrow_range`` [-127, 127], a fixed ``amax``. Immutable (the defaults set with
    ``set_default_quant_desc_input`` are shared by every layer built afterwards).
    """

    num_bits: int = 8
    name: str | None = None
    fake_quant: bool = True
    axis: int | tuple[int, ...] | None = None
    amax: float | None = None
    unsigned: bool = False
    narrow_range: bool = False
    calib_method: str = "max"
    learn_amax: bool = False
    scale_amax: float | None = None

    def __post_init__(self) -> None:
        if self.num_bits != 8:
            raise UsageError(f"QuantDescriptor(num_bits={self.num_bits!r}): only 8 bits are fake-quantized; for "
                             "4-bit weights use overdrive.quant.weight_only(model, bits=4)")
        if self.calib_method not in ("max", "histogram"):
            raise UsageError(f"calib_method={self.calib_method!r} must be 'max' or 'histogram'")
        for flag, ok, why in (("unsigned", False, "quantization is symmetric, zero point 0"),
                              ("fake_quant", True, "real int8 is overdrive.quant.to_real(model) after calibration"),
                              ("learn_amax", False, "amax stays fixed in QAT (clipped straight-through gradient)")):
            if getattr(self, flag) != ok:
                raise UsageError(f"QuantDescriptor({flag}={getattr(self, flag)!r}) is not supported: {why}")
        if self.scale_amax is not None:
            raise UsageError("QuantDescriptor(scale_amax=...) is not supported; scale the amax yourself")
        # as given, as in pytorch-quantization: a tuple stays a tuple ((0,)), an int an int (that also reads as (0,))
        axis = _Axis(self.axis) if isinstance(self.axis, int) else (tuple(self.axis) if self.axis is not None else None)
        if axis is not None and len(axis) != 1:
            raise UsageError(f"axis={self.axis!r}: one per-channel axis at most, e.g. axis=(0,)")
        object.__setattr__(self, "axis", axis)

    @property
    def per_channel_axis(self) -> int | None:
        return None if self.axis is None else self.axis[0]

    def quantizer_config(self) -> QuantizerConfig:
        return QuantizerConfig(format="int8", per_channel=self.axis is not None, narrow_range=self.narrow_range)


# pytorch-quantization writes the per-channel ones axis=(0) / axis=(1): the int, which their axis gives back
QUANT_DESC_8BIT_PER_TENSOR = QuantDescriptor(num_bits=8)
QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=1)
QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=1)
QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=1)


def _quantizer_for(inputs: torch.Tensor, amax: torch.Tensor | float, num_bits: int, unsigned: bool,
                   narrow_range: bool) -> TensorQuantizer:
    """A calibrated TensorQuantizer for ``amax`` broadcast against ``inputs`` (scalar, or one non-1 dim)."""
    QuantDescriptor(num_bits=num_bits, unsigned=unsigned)  # the same checks and messages
    amax = torch.as_tensor(amax, dtype=torch.float32, device=inputs.device).detach()
    axis = None
    if amax.numel() > 1:
        dims = [d for d, s in enumerate(amax.shape) if s != 1]
        if len(dims) != 1 or amax.dim() > inputs.dim():
            raise UsageError(f"amax of shape {tuple(amax.shape)} must be a scalar or vary along one axis of the "
                             f"input {tuple(inputs.shape)} (e.g. (C, 1) for per-row)")
        axis = inputs.dim() - amax.dim() + dims[0]  # broadcasting aligns the trailing dims
    q = TensorQuantizer(QuantizerConfig(per_channel=axis is not None, narrow_range=narrow_range), axis=axis)
    q.amax = amax.reshape(-1) if axis is not None else amax.reshape(())
    return q


def fake_tensor_quant(inputs: torch.Tensor, amax: torch.Tensor | float, num_bits: int = 8, unsigned: bool = False,
                      narrow_range: bool = True) -> torch.Tensor:
    """Quantize-dequantize ``inputs`` with scale amax/127 (pytorch-quantization's defaults: narrow range
    [-127, 127]); the gradient passes where |x| <= amax."""
    return _quantizer_for(inputs, amax, num_bits, unsigned, narrow_range)(inputs)


def tensor_quant(inputs: torch.Tensor, amax: torch.Tensor | float, num_bits: int = 8, unsigned: bool = False,
                 narrow_range: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(the integer values as floats, scale 127/amax): pytorch-quantization's ``tensor_quant``."""
    q = _quantizer_for(inputs, amax, num_bits, unsigned, narrow_range)
    step = q.scale()
    if q.axis is not None:
        step = step.view([-1 if d == q.axis else 1 for d in range(inputs.dim())])
    return torch.round(q(inputs) / step), 1.0 / step


__all__ = ["QuantDescriptor", "fake_tensor_quant", "tensor_quant", "QUANT_DESC_8BIT_PER_TENSOR",
           "QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW", "QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL",
           "QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL", "QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL",
           "QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL", "QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL",
           "QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL"]
