"""``apex.optimizers.fp16_optimizer``: FP16_Optimizer, from :mod:`overdrive.apex.optimizers`."""

from overdrive.apex.optimizers import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
