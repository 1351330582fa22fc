"""pytorch-quantization's ``calib``: ``MaxCalibrator`` and ``HistogramCalibrator``.

``isinstance(quantizer._calibrator, calib.MaxCalibrator)`` (the TensorRT samples' test) holds for the
calibrators of every overdrive quantizer, and the classes can be built directly with pytorch-quantization's
arguments (``MaxCalibrator(num_bits, axis, unsigned)``, ``HistogramCalibrator(num_bits, axis, unsigned,
num_bins=2048)``) and then ``collect(x)`` / ``compute_amax(...)`` / ``reset()``. A per-channel amax is (C,), where
pytorch-quantization keeps the reduced dimensions ((C, 1) for a Linear weight).

Example:
    >>> import torch
    >>> cal = HistogramCalibrator(8, None, False)
    >>> cal.collect(torch.linspace(-1, 1, 10001))
    >>> round(float(cal.compute_amax("percentile", percentile=99.0)), 2)
    0.99
    >>> MaxCalibrator(8, None, False).compute_amax() is None
    True
"""

from __future__ import annotations

from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant import calibrators as _native


class _SameAsNative(type):
    """``isinstance(c, calib.MaxCalibrator)`` holds for overdrive's own MaxCalibrator too (every quantizer's)."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls.__mro__[1])


def _one_axis(axis: Any) -> int | None:
    if axis is None:
        return None
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if len(axes) != 1:
        raise UsageError(f"axis={axis!r}: one per-channel axis at most, e.g. axis=(0,)")
    return int(axes[0])


def _check_bits(num_bits: int, unsigned: bool) -> None:
    if num_bits != 8 or unsigned:
        raise UsageError(f"calibrator num_bits={num_bits!r}, unsigned={unsigned!r}: only signed 8-bit is supported")


class MaxCalibrator(_native.MaxCalibrator, metaclass=_SameAsNative):
    """pytorch-quantization's MaxCalibrator(num_bits, axis, unsigned, track_amax=False)."""

    def __init__(self, num_bits: int = 8, axis: Any = None, unsigned: bool = False, track_amax: bool = False) -> None:
        _check_bits(num_bits, unsigned)
        if track_amax:
            raise UsageError("MaxCalibrator(track_amax=True) is not supported; keep the amax of each batch yourself")
        super().__init__(_one_axis(axis))

    def compute_amax(self, method: str = "max", percentile: float | None = None) -> torch.Tensor | None:
        """The max so far (None before any data, as in pytorch-quantization)."""
        return None if self.amax is None else self.amax.clone()

    def reset(self) -> None:
        self.amax = None


class HistogramCalibrator(_native.HistogramCalibrator, metaclass=_SameAsNative):
    """pytorch-quantization's HistogramCalibrator(num_bits, axis, unsigned, num_bins=2048); per tensor only, as
    there. ``compute_amax(method, percentile=...)``: "entropy", "mse", "percentile" (and "max")."""

    def __init__(self, num_bits: int = 8, axis: Any = None, unsigned: bool = False, num_bins: int = 2048,
                 grow_method: str | None = None, skip_zeros: bool = False, torch_hist: bool = True) -> None:
        _check_bits(num_bits, unsigned)
        if axis is not None:
            raise UsageError("HistogramCalibrator collects per tensor only (axis=None), as in pytorch-quantization")
        if skip_zeros:
            raise UsageError("HistogramCalibrator(skip_zeros=True) is not supported; zeros are counted in bin 0")
        super().__init__(num_bins, max_bins=_native.MODELOPT_MAX_BINS_FACTOR * num_bins)

    def compute_amax(self, method: str = "max", *, stride: int = 1, start_bin: int = 128,  # type: ignore[override]
                     percentile: float = 99.99) -> torch.Tensor:
        return super().compute_amax(method, percentile, stride=stride, start_bin=start_bin)

    def reset(self) -> None:
        self.__init__(num_bins=self.num_bins)  # type: ignore[misc]


__all__ = ["MaxCalibrator", "HistogramCalibrator"]
