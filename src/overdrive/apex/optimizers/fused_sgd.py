"""``apex.optimizers.fused_sgd``: FusedSGD, from :mod:`overdrive.apex.optimizers`."""

from overdrive.apex.optimizers import FusedSGD

__all__ = ["FusedSGD"]
