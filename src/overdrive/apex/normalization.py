"""apex's ``apex.normalization`` over torch's norms: ``FusedLayerNorm``, ``FusedRMSNorm`` and their ``Mixed``
forms, so ``from apex.normalization import FusedLayerNorm`` ports by changing the import only.

apex fused these for speed on 2018-era torch; torch's own LayerNorm / RMSNorm CUDA kernels are fused today. What
apex's kernels did beyond that is kept: statistics in fp32 for fp16/bf16 inputs, and an input whose dtype differs
from the parameters' (fp16 activations into fp32 weights, as O2 with norms kept fp32, or the ``Mixed`` classes)
normalized in fp32 and returned in the input's dtype (torch's own norms refuse that mix on CPU). The parameters
are named as apex names them (``weight``, ``bias``), so apex checkpoints load. ``memory_efficient`` (apex's
recompute-in-backward switch) is accepted; it changes no numbers.

Example:
    >>> import torch
    >>> from overdrive.apex.normalization import FusedLayerNorm
    >>> ln = FusedLayerNorm(8)
    >>> ln(torch.randn(2, 8, dtype=torch.bfloat16)).dtype
    torch.bfloat16
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_HALF = (torch.float16, torch.bfloat16)


def _mixed(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether ``x`` must be normalized in fp32: its dtype is not its parameters'."""
    return weight is not None and x.dtype != weight.dtype


class FusedLayerNorm(nn.LayerNorm):
    """``apex.normalization.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``: torch's
    LayerNorm, with an input of another dtype than its parameters normalized in fp32 and returned in the
    input's dtype.

    Example:
        >>> ln = FusedLayerNorm([4, 8], eps=1e-6)
        >>> ln(torch.randn(3, 4, 8)).shape
        torch.Size([3, 4, 8])
    """

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False, **kwargs: Any) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **kwargs)
        self.memory_efficient = memory_efficient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _mixed(x, self.weight):
            return super().forward(x)
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


class MixedFusedLayerNorm(FusedLayerNorm):
    """``apex.normalization.MixedFusedLayerNorm``: fp32 parameters normalizing fp16/bf16 activations (Megatron's
    choice), the output in the activations' dtype.

    Example:
        >>> ln = MixedFusedLayerNorm(8)
        >>> ln(torch.randn(2, 8).half()).dtype, ln.weight.dtype
        (torch.float16, torch.float32)
    """


class FusedRMSNorm(nn.RMSNorm):
    """``apex.normalization.FusedRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``: torch's RMSNorm
    with apex's default eps (1e-5; torch's default is the dtype's epsilon), the mean square taken in fp32 for
    fp16/bf16 inputs, and a mixed input/parameter dtype handled as :class:`FusedLayerNorm` handles it.

    Example:
        >>> FusedRMSNorm(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False, **kwargs: Any) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **kwargs)
        self.memory_efficient = memory_efficient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in _HALF or _mixed(x, self.weight):  # apex's kernel: statistics in fp32
            w = self.weight.float() if self.weight is not None else None
            return F.rms_norm(x.float(), self.normalized_shape, w, self.eps).to(x.dtype)
        return super().forward(x)


class MixedFusedRMSNorm(FusedRMSNorm):
    """``apex.normalization.MixedFusedRMSNorm``: fp32 parameters, fp16/bf16 activations, output in their dtype.

    Example:
        >>> MixedFusedRMSNorm(8)(torch.randn(2, 8).bfloat16()).dtype
        torch.bfloat16
    """


__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm"]
