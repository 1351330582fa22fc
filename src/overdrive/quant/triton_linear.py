"""Linear layers on the int8/fp8 convolution kernel (``overdrive::conv2d_q`` on the ``(tokens, K, 1, 1)`` view of their
input, the same memory), so that an engine fuses the activation after them and the next layer's quantize into the
kernel's epilogue (``engine/lowp_conv_fusion.py``), which a cuBLAS GEMM cannot take.

    >>> q = Int8TritonLinear.from_linear(torch.nn.Linear(32, 16), x_amax=torch.tensor(4.0))
    >>> q(torch.randn(3, 32)).shape
    torch.Size([3, 16])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.conv import Int8Conv2d


class Int8TritonLinear(Int8Conv2d):
    """A Linear layer (``y = x W^T + b`` over the last dimension) on the convolution kernel: a 1x1 convolution over
    the ``(tokens, K, 1, 1)`` view of its input, which is the same memory. Where a cuBLAS GEMM writes fp16 and leaves
    what follows to passes of their own, this kernel takes it into its epilogue in an engine (a GELU / SiLU / ReLU
    after the layer, the next layer's quantize: a transformer MLP's first layer then writes the 8-bit input of the
    second, one byte per element, and no pass reads it again); weights per output channel (fp8 too).

    Built by ``quant.to_real(..., linear_kernel="triton")`` (int8/fp8 engines on CUDA), or from a float ``nn.Linear``
    with :meth:`from_linear`; any device (the op's fp32 reference off CUDA). An engine's layer timing keeps it, swaps
    it for the cuBLAS GEMM (:meth:`library_twin`) or for the float layer, whichever runs fastest in the engine's form.

    Example:
        >>> lin = torch.nn.Linear(32, 16)
        >>> q = Int8TritonLinear.from_linear(lin, x_amax=torch.tensor(4.0))
        >>> x = torch.randn(2, 5, 32).clamp(-4, 4)
        >>> bool(F.cosine_similarity(q(x).flatten(), lin(x).flatten(), dim=0) > 0.999)
        True
    """

    fmt = "int8"

    def __init__(self, weight: torch.Tensor, w_amax: torch.Tensor, x_amax: torch.Tensor, bias: torch.Tensor | None,
                 x_qmin: int = -128, w_qmin: int = -127) -> None:
        w = weight.detach()
        super().__init__(w.reshape(w.shape[0], w.shape[1], 1, 1), w_amax, x_amax, bias, x_qmin=x_qmin, w_qmin=w_qmin)
        self.weight_dtype = weight.dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, x_amax: torch.Tensor, w_amax: torch.Tensor | None = None
                    ) -> Int8TritonLinear:
        """From a float ``nn.Linear`` and its input's amax (one number, per tensor; ``w_amax``: per output feature,
        default the weights')."""
        if not isinstance(linear, nn.Linear):
            raise UsageError(f"{cls.__name__}.from_linear takes an nn.Linear, got {type(linear).__name__}; for a "
                             "convolution use Int8Conv2d / Fp8Conv2d.from_float")
        reason = linear_unsupported(linear.in_features, linear.out_features)
        if reason:
            raise UsageError(f"{cls.__name__}.from_linear: {reason}")
        x_amax = torch.as_tensor(x_amax, dtype=torch.float32)
        if x_amax.numel() != 1:
            raise UsageError(f"{cls.__name__}.from_linear: x_amax of shape {tuple(x_amax.shape)}: the input is "
                             "quantized per tensor, so give one number (its calibrated amax)")
        w = linear.weight.detach()
        return cls(w, w.float().abs().amax(dim=1) if w_amax is None else w_amax, x_amax, linear.bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        probe = fn(torch.empty(0, dtype=self.weight_dtype))  # .half() / .float(): the dtype `weight` reads back in
        if probe.is_floating_point():
            self.weight_dtype = probe.dtype
        return super()._apply(fn, recurse)

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) weight the kernel computes with, dequantized, in the float layer's dtype (model code reads
        ``layer.weight.dtype``; a cast of the model changes it, as it would a float layer's)."""
        return self.dequantized_weight().reshape(self.out_channels, self.in_channels).to(self.weight_dtype)

    def library_twin(self) -> nn.Module:
        """The same layer on cuBLAS (``torch._int_mm`` / ``torch._scaled_mm``: an
        :class:`~overdrive.quant.real.Int8Linear`), from the weights this one computes with (int8: the same integers; fp8: one per-tensor weight scale, as
        ``_scaled_mm`` takes it), quantizing its input with ``overdrive::quantize`` so that an engine can still fold
        that into the layer before."""
        from overdrive.quant.real import Fp8Linear, Int8Linear

        cls = Fp8Linear if self.fmt == "fp8" else Int8Linear
        bound = 127.0 if self.fmt == "int8" else 448.0
        w = self.dequantized_weight().reshape(self.out_channels, self.in_channels)
        bias = None if self.bias is None else self.bias.to(self.weight_dtype)
        # w_qmin -128: the stored integers are this layer's (a wide-range quantizer's -128 stays -128)
        twin = cls(w, self.w_scale * bound, self.x_scale * bound, bias, x_qmin=self.x_qmin, w_qmin=-128)
        twin.weight_dtype = self.weight_dtype
        twin.quantize_op = True
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K)
        if x.dim() == 0 or x.shape[-1] != self.in_channels or not x.is_floating_point():
            raise UsageError(f"{type(self).__name__}({self.in_channels}, {self.out_channels}): got an input of shape "
                             f"{tuple(x.shape)} and dtype {x.dtype}; expected a float tensor whose last dim is "
                             f"{self.in_channels}")
        y = super().forward(x.reshape(-1, self.in_channels, 1, 1))
        return y.reshape(*x.shape[:-1], self.out_channels)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, {self.fmt}, Triton"


class Fp8TritonLinear(Int8TritonLinear):
    """:class:`Int8TritonLinear` on fp8 e4m3 tensor cores (scales amax / 448).

    Example:
        >>> Fp8TritonLinear.from_linear(torch.nn.Linear(32, 16), x_amax=torch.tensor(4.0)).w_q.dtype
        torch.float8_e4m3fn
    """

    fmt = "fp8"


def linear_unsupported(in_features: int, out_features: int) -> str | None:
    """Why a Linear layer cannot run as :class:`Int8TritonLinear` (None when it can).

    Example:
        >>> linear_unsupported(768, 3072) is None, linear_unsupported(100, 64)[:30]
        (True, 'in_features=100 not a multiple')
    """
    if in_features % 16:
        return f"in_features={in_features} not a multiple of 16 (the tensor cores' K step)"
    if out_features % 8:
        return f"out_features={out_features} not a multiple of 8"
    return None
