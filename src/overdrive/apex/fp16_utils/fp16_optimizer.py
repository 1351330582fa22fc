"""``apex.fp16_utils.fp16_optimizer``: :class:`~overdrive.apex.fp16_utils.FP16_Optimizer` under its module path."""

from overdrive.apex.fp16_utils import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
