"""apex's ``apex.normalization``: the norm layers of :mod:`overdrive.apex.normalization.fused_layer_norm`, under both
of apex's import paths (``from apex.normalization import FusedLayerNorm`` and ``from
apex.normalization.fused_layer_norm import FusedLayerNorm``).

Example:
    >>> import torch
    >>> from overdrive.apex.normalization import FusedLayerNorm
    >>> ln = FusedLayerNorm(8)
    >>> ln(torch.randn(2, 8, dtype=torch.bfloat16)).dtype
    torch.bfloat16
"""

from overdrive.apex.normalization.fused_layer_norm import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
)

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]
