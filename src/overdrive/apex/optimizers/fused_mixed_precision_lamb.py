"""``apex.optimizers.fused_mixed_precision_lamb``: FusedMixedPrecisionLamb, from :mod:`overdrive.apex.optimizers`."""

from overdrive.apex.optimizers import FusedMixedPrecisionLamb

__all__ = ["FusedMixedPrecisionLamb"]
