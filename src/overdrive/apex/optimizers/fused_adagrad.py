"""``apex.optimizers.fused_adagrad``: FusedAdagrad, from :mod:`overdrive.apex.optimizers`."""

from overdrive.apex.optimizers import FusedAdagrad

__all__ = ["FusedAdagrad"]
