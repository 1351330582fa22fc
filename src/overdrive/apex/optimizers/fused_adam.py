"""``apex.optimizers.fused_adam``: FusedAdam, from :mod:`overdrive.apex.optimizers`."""

from overdrive.apex.optimizers import FusedAdam

__all__ = ["FusedAdam"]
