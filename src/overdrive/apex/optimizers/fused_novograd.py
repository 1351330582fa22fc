"""``apex.optimizers.fused_novograd``: FusedNovoGrad, from :mod:`overdrive.apex.optimizers`."""

from overdrive.apex.optimizers import FusedNovoGrad

__all__ = ["FusedNovoGrad"]
