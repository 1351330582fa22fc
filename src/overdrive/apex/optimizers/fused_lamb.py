"""``apex.optimizers.fused_lamb``: FusedLAMB, from :mod:`overdrive.apex.optimizers`."""

from overdrive.apex.optimizers import FusedLAMB

__all__ = ["FusedLAMB"]
