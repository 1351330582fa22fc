"""apex's ``apex.normalization.fused_layer_norm`` over torch's norms: ``FusedLayerNorm``, ``FusedRMSNorm`` and their
``Mixed`` forms, and the functional forms apex's module held (``FusedLayerNormAffineFunction.apply``,
``fused_layer_norm_affine``, ``manual_rms_norm``, ...: Megatron's and NeMo's imports), so ``from apex.normalization
import FusedLayerNorm`` and ``from apex.normalization.fused_layer_norm import FusedLayerNorm`` port by changing the
import only.

apex fused these for speed on 2018-era torch; torch's own LayerNorm / RMSNorm CUDA kernels are fused today. What
apex's kernels did beyond that is kept, on every device (CPU runs the same code as CUDA):

- statistics in fp32 for fp16/bf16 inputs;
- under ``torch.autocast`` the input, weight and bias are cast to the autocast dtype first (apex's
  ``_cast_if_autocast_enabled``), so the output is fp16/bf16 and the gradients flow back to the fp32 tensors
  through the cast (torch's own norms return fp32 under autocast);
- ``FusedLayerNorm`` / ``FusedRMSNorm`` return the input's dtype; the ``Mixed`` classes (and
  ``mixed_dtype_fused_*_affine``) return the parameters' dtype: Megatron's fp32 residual stream into bf16
  norm weights comes out bf16, fp16 activations into fp32 weights come out fp32;
- an input whose dtype differs from the parameters' is normalized in the wider dtype (torch's own norms
  refuse that mix on CPU).

``FusedLayerNormAffineFunction.apply`` and the other autograd-function names run apex's kernels as called
directly: no autocast cast, the output in the input's dtype (``...MixedDtypesFunction``: the weight's). The
parameters are named as apex names them (``weight``, ``bias``), so apex checkpoints load. ``memory_efficient``
(apex's save-the-output-for-backward switch) is accepted; it changes no numbers.

Example:
    >>> import torch
    >>> from overdrive.apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction, FusedLayerNorm
    >>> x = torch.randn(2, 8, dtype=torch.bfloat16)  # Megatron: bf16 activations, fp32 parameters
    >>> FusedLayerNormAffineFunction.apply(x, torch.ones(8), torch.zeros(8), (8,), 1e-5).dtype
    torch.bfloat16
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     FusedLayerNorm(8)(torch.randn(2, 8)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_HALF = (torch.float16, torch.bfloat16)


# --- the core: autocast off, the dtypes apex's kernels give ---------------------------------------------------

def _no_autocast(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off for ``x``'s device while a norm runs: its dtypes are set here, not by autocast's op lists
    (which would run layer_norm in fp32 and return fp32)."""
    try:
        if torch.is_autocast_enabled(x.device.type):
            return torch.autocast(x.device.type, enabled=False)
    except RuntimeError:  # a device autocast does not know (meta)
        pass
    return contextlib.nullcontext()


def _autocast_cast(x: torch.Tensor, *params: torch.Tensor | None) -> tuple[Any, ...]:
    """apex's ``_cast_if_autocast_enabled``: under autocast for ``x``'s device, every floating tensor but float64
    cast to the autocast dtype (a differentiable cast: gradients reach the fp32 originals)."""
    try:
        if not torch.is_autocast_enabled(x.device.type):
            return (x, *params)
        dtype = torch.get_autocast_dtype(x.device.type)
    except RuntimeError:
        return (x, *params)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(dtype)

    return tuple(cast(t) for t in (x, *params))


def _compute_dtype(x: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype | None:
    """The dtype to normalize in when torch's kernel cannot take the tensors as they are (parameters of another
    dtype than the input): the widest of them and fp32. None: as they are; torch's layer / RMS norm kernels keep
    fp32 statistics for fp16/bf16 themselves, and no fp32 copy of the activations is saved for backward."""
    others = [p.dtype for p in params if p is not None]
    if all(d == x.dtype for d in others):
        return None
    dtype = torch.float32
    for d in (x.dtype, *others):
        dtype = torch.promote_types(dtype, d)
    return dtype


def _shape(normalized_shape: Any) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    try:
        if isinstance(normalized_shape, str):
            raise TypeError
        return tuple(int(d) for d in normalized_shape)
    except (TypeError, ValueError):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints (a list, tuple or torch.Size), "
                        f"got {normalized_shape!r}; pass e.g. hidden_size or x.shape[-2:]") from None


def _layer_norm(x: torch.Tensor, shape: Any, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                out_dtype: torch.dtype) -> torch.Tensor:
    shape = _shape(shape)
    with _no_autocast(x):
        dtype = _compute_dtype(x, weight, bias)
        if dtype is None:
            y = F.layer_norm(x, shape, weight, bias, eps)
        else:
            y = F.layer_norm(x.to(dtype), shape, None if weight is None else weight.to(dtype),
                             None if bias is None else bias.to(dtype), eps)
        return y.to(out_dtype)


def _rms_norm(x: torch.Tensor, shape: Any, weight: torch.Tensor | None, eps: float,
              out_dtype: torch.dtype) -> torch.Tensor:
    shape = _shape(shape)
    with _no_autocast(x):
        dtype = _compute_dtype(x, weight)
        if dtype is None:
            y = F.rms_norm(x, shape, weight, eps)
        else:
            y = F.rms_norm(x.to(dtype), shape, None if weight is None else weight.to(dtype), eps)
        return y.to(out_dtype)


# --- the functional forms -----------------------------------------------------------------------------------

def fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,  # noqa: A002
                            normalized_shape: Any, eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_layer_norm_affine``: layer norm with ``weight`` and ``bias``, statistics in fp32 for half
    inputs, the output in the input's dtype (the autocast dtype under autocast; ``memory_efficient`` changes no
    numbers).

    Example:
        >>> x = torch.randn(2, 8); w, b = torch.ones(8), torch.zeros(8)
        >>> torch.allclose(fused_layer_norm_affine(x, w, b, 8), F.layer_norm(x, (8,), w, b, 1e-6))
        True
    """
    input, weight, bias = _autocast_cast(input, weight, bias)  # noqa: A001
    return _layer_norm(input, normalized_shape, weight, bias, eps, input.dtype)


def fused_layer_norm(input: torch.Tensor, normalized_shape: Any, eps: float = 1e-6,  # noqa: A002
                     memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_layer_norm``: layer norm without an affine transform.

    Example:
        >>> fused_layer_norm(torch.randn(2, 8), 8).std(dim=-1, unbiased=False).round().tolist()
        [1.0, 1.0]
    """
    (input,) = _autocast_cast(input)  # noqa: A001
    return _layer_norm(input, normalized_shape, None, None, eps, input.dtype)


def mixed_dtype_fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,  # noqa: A002
                                        normalized_shape: Any, eps: float = 1e-6,
                                        memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``mixed_dtype_fused_layer_norm_affine``: as :func:`fused_layer_norm_affine`, the output in the
    weight's dtype.

    Example:
        >>> mixed_dtype_fused_layer_norm_affine(torch.randn(2, 8).half(), torch.ones(8), torch.zeros(8), 8).dtype
        torch.float32
    """
    input, weight, bias = _autocast_cast(input, weight, bias)  # noqa: A001
    return _layer_norm(input, normalized_shape, weight, bias, eps, weight.dtype)


def fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor | None, normalized_shape: Any,  # noqa: A002
                          eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_rms_norm_affine``: RMS norm with ``weight``, the mean square in fp32 for half inputs, the
    output in the input's dtype (the autocast dtype under autocast).

    Example:
        >>> fused_rms_norm_affine(torch.full((1, 4), 2.0), torch.ones(4), 4).round(decimals=4).tolist()
        [[1.0, 1.0, 1.0, 1.0]]
    """
    input, weight = _autocast_cast(input, weight)  # noqa: A001
    return _rms_norm(input, normalized_shape, weight, eps, input.dtype)


def fused_rms_norm(input: torch.Tensor, normalized_shape: Any, eps: float = 1e-6,  # noqa: A002
                   memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``fused_rms_norm``: RMS norm without a weight."""
    (input,) = _autocast_cast(input)  # noqa: A001
    return _rms_norm(input, normalized_shape, None, eps, input.dtype)


def mixed_dtype_fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor, normalized_shape: Any,  # noqa: A002
                                      eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    """apex's ``mixed_dtype_fused_rms_norm_affine``: as :func:`fused_rms_norm_affine`, the output in the weight's
    dtype."""
    input, weight = _autocast_cast(input, weight)  # noqa: A001
    return _rms_norm(input, normalized_shape, weight, eps, weight.dtype)


def manual_rms_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None,  # noqa: A002
                    eps: float) -> torch.Tensor:
    """apex's ``manual_rms_norm(input, normalized_shape, weight, eps)`` (its CPU path, Hugging Face's RMSNorm):
    the mean square in fp32; the result is fp32 for a half input, cast to the weight's dtype when that is half
    before the weight multiplies it.

    Example:
        >>> manual_rms_norm(torch.full((1, 4), 2.0).half(), (4,), None, 1e-6).dtype
        torch.float32
    """
    dims = tuple(range(-len(_shape(normalized_shape)), 0))
    variance = input.to(torch.float32).pow(2).mean(dims, keepdim=True)
    y = input * torch.rsqrt(variance + eps)  # (*, *normalized_shape), float32 or wider
    if weight is None:
        return y
    if weight.dtype in _HALF:
        y = y.to(weight.dtype)
    return weight * y


# --- the modules --------------------------------------------------------------------------------------------

class FusedLayerNorm(nn.LayerNorm):
    """``apex.normalization.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True,
    memory_efficient=False)``: torch's LayerNorm with apex's dtypes: the output in the input's dtype (the autocast
    dtype under autocast), an input of another dtype than the parameters normalized in the wider one.

    Example:
        >>> ln = FusedLayerNorm([4, 8], eps=1e-6)
        >>> ln(torch.randn(3, 4, 8)).shape
        torch.Size([3, 4, 8])
    """

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False, **kwargs: Any) -> None:
        super().__init__(_shape(normalized_shape), eps=eps, elementwise_affine=elementwise_affine, **kwargs)
        self.memory_efficient = memory_efficient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_layer_norm_affine(x, self.weight, self.bias, self.normalized_shape, self.eps)


class FusedRMSNorm(nn.RMSNorm):
    """``apex.normalization.FusedRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True,
    memory_efficient=False)``: torch's RMSNorm with apex's default eps (1e-5; torch's default is the dtype's
    epsilon), the mean square in fp32 for fp16/bf16 inputs, and apex's dtypes as :class:`FusedLayerNorm` has them.

    Example:
        >>> FusedRMSNorm(8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False, **kwargs: Any) -> None:
        super().__init__(_shape(normalized_shape), eps=eps, elementwise_affine=elementwise_affine, **kwargs)
        self.memory_efficient = memory_efficient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm_affine(x, self.weight, self.normalized_shape, self.eps)


def _mixed_kwargs(cls: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """apex's ``Mixed*`` constructors: ``elementwise_affine`` warned about (``False`` refused), other keywords
    dropped (NeMo passes its own); ``device`` / ``dtype`` kept, as torch's norms take them."""
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{cls} does not support the `elementwise_affine` argument (it always has a weight)",
                      stacklevel=3)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{cls} does not support elementwise_affine=False: its parameters set the output "
                               f"dtype; use {cls[len('Mixed'):]}(..., elementwise_affine=False) instead")
    kept = {k: kwargs.pop(k) for k in ("device", "dtype") if k in kwargs}
    if kwargs:
        warnings.warn(f"{cls} ignores the keyword arguments {sorted(kwargs)} (as apex's does)", stacklevel=3)
    return kept


class MixedFusedLayerNorm(FusedLayerNorm):
    """``apex.normalization.MixedFusedLayerNorm(normalized_shape, eps=1e-5, *, memory_efficient=False)``: the
    output in the parameters' dtype, not the input's (Megatron: an fp32 residual stream into bf16 norm weights
    comes out bf16); under autocast, the autocast dtype.

    Example:
        >>> ln = MixedFusedLayerNorm(8).bfloat16()
        >>> ln(torch.randn(2, 8)).dtype
        torch.bfloat16
    """

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, memory_efficient=memory_efficient,
                         **_mixed_kwargs(type(self).__name__, kwargs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_layer_norm_affine(x, self.weight, self.bias, self.normalized_shape, self.eps)


class MixedFusedRMSNorm(FusedRMSNorm):
    """``apex.normalization.MixedFusedRMSNorm(normalized_shape, eps=1e-5, *, memory_efficient=False)``: the output
    in the weight's dtype (the autocast dtype under autocast).

    Example:
        >>> MixedFusedRMSNorm(8).bfloat16()(torch.randn(2, 8)).dtype
        torch.bfloat16
    """

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, *, memory_efficient: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, memory_efficient=memory_efficient,
                         **_mixed_kwargs(type(self).__name__, kwargs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixed_dtype_fused_rms_norm_affine(x, self.weight, self.normalized_shape, self.eps)


# --- apex's autograd functions, called as Megatron calls them -----------------------------------------------

class FusedLayerNormAffineFunction:
    """apex's autograd function, called as it was: ``FusedLayerNormAffineFunction.apply(input, weight, bias,
    normalized_shape, eps[, memory_efficient])`` (Megatron's ``FusedLayerNorm.forward``): apex's kernel called
    directly, so no autocast cast and the output in the input's dtype. torch's layer norm differentiates itself.

    Example:
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> FusedLayerNormAffineFunction.apply(x, torch.ones(8), torch.zeros(8), (8,), 1e-5).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 8])
    """

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,  # noqa: A002
              normalized_shape: Any, eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return _layer_norm(input, normalized_shape, weight, bias, eps, input.dtype)


class FusedLayerNormAffineMixedDtypesFunction:
    """``FusedLayerNormAffineMixedDtypesFunction.apply(input, weight, bias, normalized_shape, eps[,
    memory_efficient])``: the output in the weight's dtype."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,  # noqa: A002
              normalized_shape: Any, eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return _layer_norm(input, normalized_shape, weight, bias, eps, weight.dtype)


class FusedLayerNormFunction:
    """``FusedLayerNormFunction.apply(input, normalized_shape, eps[, memory_efficient])``: layer norm without an
    affine transform, the output in the input's dtype."""

    @staticmethod
    def apply(input: torch.Tensor, normalized_shape: Any, eps: float,  # noqa: A002
              memory_efficient: bool = False) -> torch.Tensor:
        return _layer_norm(input, normalized_shape, None, None, eps, input.dtype)


class FusedRMSNormAffineFunction:
    """``FusedRMSNormAffineFunction.apply(input, weight, normalized_shape, eps[, memory_efficient])``: the output
    in the input's dtype."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor | None, normalized_shape: Any, eps: float,  # noqa: A002
              memory_efficient: bool = False) -> torch.Tensor:
        return _rms_norm(input, normalized_shape, weight, eps, input.dtype)


class FusedRMSNormAffineMixedDtypesFunction:
    """``FusedRMSNormAffineMixedDtypesFunction.apply(input, weight, normalized_shape, eps[, memory_efficient])``:
    the output in the weight's dtype."""

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, normalized_shape: Any, eps: float,  # noqa: A002
              memory_efficient: bool = False) -> torch.Tensor:
        return _rms_norm(input, normalized_shape, weight, eps, weight.dtype)


class FusedRMSNormFunction:
    """``FusedRMSNormFunction.apply(input, normalized_shape, eps[, memory_efficient])``: RMS norm without a
    weight, the output in the input's dtype."""

    @staticmethod
    def apply(input: torch.Tensor, normalized_shape: Any, eps: float,  # noqa: A002
              memory_efficient: bool = False) -> torch.Tensor:
        return _rms_norm(input, normalized_shape, None, eps, input.dtype)


# Names earlier overdrive releases gave the mixed-dtype functions.
MixedFusedLayerNormAffineFunction = FusedLayerNormAffineMixedDtypesFunction
MixedFusedRMSNormAffineFunction = FusedRMSNormAffineMixedDtypesFunction

__all__ = ["FusedLayerNorm", "FusedLayerNormAffineFunction", "FusedLayerNormAffineMixedDtypesFunction",
           "FusedLayerNormFunction", "FusedRMSNorm", "FusedRMSNormAffineFunction",
           "FusedRMSNormAffineMixedDtypesFunction", "FusedRMSNormFunction", "MixedFusedLayerNorm",
           "MixedFusedLayerNormAffineFunction", "MixedFusedRMSNorm", "MixedFusedRMSNormAffineFunction",
           "fused_layer_norm", "fused_layer_norm_affine", "fused_rms_norm", "fused_rms_norm_affine",
           "manual_rms_norm", "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine"]
