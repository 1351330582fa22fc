"""apex's ``apex.normalization.fused_layer_norm`` over torch's norms: ``FusedLayerNorm``, ``FusedRMSNorm`` and their
``Mixed`` forms, and the functional forms apex's module held (``FusedLayerNormAffineFunction.apply``,
``fused_layer_norm_affine``, ...: Megatron's and NeMo's imports), so ``from apex.normalization import FusedLayerNorm``
and ``from apex.normalization.fused_layer_norm import FusedLayerNorm`` port by changing the import only.

apex fused these for speed on 2018-era torch; torch's own LayerNorm / RMSNorm CUDA kernels are fused today. What
apex's kernels did beyond that is kept: statistics in fp32 for fp16/bf16 inputs, and an input whose dtype differs
from the parameters' (fp16 activations into fp32 weights, as O2 with norms kept fp32, or the ``Mixed`` classes)
normalized in fp32 and returned in the input's dtype (torch's own norms refuse that mix on CPU). The parameters
are named as apex names them (``weight``, ``bias``), so apex checkpoints load. ``memory_efficient`` (apex's
recompute-in-backward switch) is accepted; it changes no numbers.

Example:
    >>> import torch
    >>> from overdrive.apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction
    >>> x = torch.randn(2, 8, dtype=torch.bfloat16)  # Megatron: bf16 activations, fp32 parameters
    >>> FusedLayerNormAffineFunction.apply(x, torch.ones(8), torch.zeros(8), (8,), 1e-5).dtype
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


def fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,  # noqa: A002
                            normalized_shape: Any, eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_layer_norm_affine``: layer norm with ``weight`` and ``bias``, statistics in fp32 for half
    inputs, the output in the input's dtype (``memory_efficient`` changes no numbers).

    Example:
        >>> x = torch.randn(2, 8); w, b = torch.ones(8), torch.zeros(8)
        >>> torch.allclose(fused_layer_norm_affine(x, w, b, 8), F.layer_norm(x, (8,), w, b, 1e-6))
        True
    """
    shape = _shape(normalized_shape)
    if _needs_fp32(input, weight):
        w = weight.float() if weight is not None else None
        b = bias.float() if bias is not None else None
        return F.layer_norm(input.float(), shape, w, b, eps).to(input.dtype)
    return F.layer_norm(input, shape, weight, bias, eps)


def fused_layer_norm(input: torch.Tensor, normalized_shape: Any, eps: float = 1e-6,  # noqa: A002
                     memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_layer_norm``: layer norm without an affine transform.

    Example:
        >>> fused_layer_norm(torch.randn(2, 8), 8).std(dim=-1, unbiased=False).round().tolist()
        [1.0, 1.0]
    """
    return fused_layer_norm_affine(input, None, None, normalized_shape, eps)


def fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor | None, normalized_shape: Any,  # noqa: A002
                          eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_rms_norm_affine``: RMS norm with ``weight``, the mean square in fp32 for half inputs.

    Example:
        >>> fused_rms_norm_affine(torch.full((1, 4), 2.0), torch.ones(4), 4).round(decimals=4).tolist()
        [[1.0, 1.0, 1.0, 1.0]]
    """
    shape = _shape(normalized_shape)
    if _needs_fp32(input, weight) or input.dtype in _HALF:
        w = weight.float() if weight is not None else None
        return F.rms_norm(input.float(), shape, w, eps).to(input.dtype)
    return F.rms_norm(input, shape, weight, eps)


def fused_rms_norm(input: torch.Tensor, normalized_shape: Any, eps: float = 1e-6,  # noqa: A002
                   memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_rms_norm``: RMS norm without a weight."""
    return fused_rms_norm_affine(input, None, normalized_shape, eps)


mixed_dtype_fused_layer_norm_affine = fused_layer_norm_affine
mixed_dtype_fused_rms_norm_affine = fused_rms_norm_affine


class FusedLayerNormAffineFunction:
    """apex's autograd function, called as it was: ``FusedLayerNormAffineFunction.apply(input, weight, bias,
    normalized_shape, eps[, memory_efficient])`` (Megatron's legacy ``MixedFusedLayerNorm.forward``). torch's
    layer norm differentiates itself, so ``apply`` is :func:`fused_layer_norm_affine`.

    Example:
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> FusedLayerNormAffineFunction.apply(x, torch.ones(8), torch.zeros(8), (8,), 1e-5).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 8])
    """

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,  # noqa: A002
              normalized_shape: Any, eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return fused_layer_norm_affine(input, weight, bias, normalized_shape, eps)


class FusedLayerNormFunction:
    """``FusedLayerNormFunction.apply(input, normalized_shape, eps[, memory_efficient])``: :func:`fused_layer_norm`."""

    @staticmethod
    def apply(input: torch.Tensor, normalized_shape: Any, eps: float,  # noqa: A002
              memory_efficient: bool = False) -> torch.Tensor:
        return fused_layer_norm(input, normalized_shape, eps)


class FusedRMSNormAffineFunction:
    """``FusedRMSNormAffineFunction.apply(input, weight, normalized_shape, eps[, memory_efficient])``:
    :func:`fused_rms_norm_affine`."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor | None, normalized_shape: Any, eps: float,  # noqa: A002
              memory_efficient: bool = False) -> torch.Tensor:
        return fused_rms_norm_affine(input, weight, normalized_shape, eps)


class FusedRMSNormFunction:
    """``FusedRMSNormFunction.apply(input, normalized_shape, eps[, memory_efficient])``: :func:`fused_rms_norm`."""

    @staticmethod
    def apply(input: torch.Tensor, normalized_shape: Any, eps: float,  # noqa: A002
              memory_efficient: bool = False) -> torch.Tensor:
        return fused_rms_norm(input, normalized_shape, eps)


MixedFusedLayerNormAffineFunction = FusedLayerNormAffineFunction
MixedFusedRMSNormAffineFunction = FusedRMSNormAffineFunction


def _shape(normalized_shape: Any) -> tuple[int, ...]:
    return (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(int(d) for d in normalized_shape)


def _needs_fp32(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether ``x`` is normalized in fp32: a half input, or one whose dtype is not its parameters'."""
    return x.dtype in _HALF or _mixed(x, weight)


__all__ = ["FusedLayerNorm", "FusedLayerNormAffineFunction", "FusedLayerNormFunction", "FusedRMSNorm",
           "FusedRMSNormAffineFunction", "FusedRMSNormFunction", "MixedFusedLayerNorm",
           "MixedFusedLayerNormAffineFunction", "MixedFusedRMSNorm", "MixedFusedRMSNormAffineFunction",
           "fused_layer_norm", "fused_layer_norm_affine", "fused_rms_norm", "fused_rms_norm_affine",
           "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine"]
