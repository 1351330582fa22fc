"""ModelOpt's ``modelopt.torch.quantization.utils``: the helpers scripts import from it (Torch-TensorRT's PTQ
examples: ``from modelopt.torch.quantization.utils import export_torch_mode``), so they port by the import line.

Example:
    >>> import torch
    >>> import overdrive.quant.modelopt as mtq
    >>> from overdrive.quant.modelopt.utils import export_torch_mode, is_quantized
    >>> m = mtq.quantize(torch.nn.Linear(4, 2), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(8, 4)))
    >>> with export_torch_mode():
    ...     ep = torch.export.export(m, (torch.randn(3, 4),))
    >>> is_quantized(m), is_quantized(torch.nn.Linear(4, 2))
    (True, False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from overdrive.quant.quantizer import TensorQuantizer


@contextlib.contextmanager
def export_torch_mode() -> Iterator[None]:
    """ModelOpt's switch that makes its quantizers trace as torch ops for ``torch.export``. overdrive's quantizers
    always do (under ``torch.export`` they trace as round/clamp arithmetic, and as QuantizeLinear/DequantizeLinear
    in an ONNX export), so this context changes nothing; it exists so ``with export_torch_mode():`` runs."""
    yield


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether ``module`` or any module inside it holds a quantizer."""
    return any(isinstance(m, TensorQuantizer) for m in module.modules())


def is_quantized_layer_with_weight(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself is a quantized layer with a weight (a Linear or convolution that
    ``quantize`` swapped: it has a ``weight`` and a ``weight_quantizer``)."""
    return isinstance(getattr(module, "weight_quantizer", None), TensorQuantizer) and hasattr(module, "weight")


def reduce_amax(x: torch.Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = True) -> torch.Tensor:
    """max(|x|) over ``axis`` (all dims when None), ModelOpt's and pytorch-quantization's ``reduce_amax``.

    Example:
        >>> reduce_amax(torch.tensor([[1.0, -3.0], [2.0, 0.5]]), axis=1).flatten().tolist()
        [3.0, 2.0]
    """
    if axis is None:
        out = x.detach().abs().amax()
        return out.reshape([1] * x.dim()) if keepdims else out
    return x.detach().abs().amax(dim=axis, keepdim=keepdims)


__all__ = ["export_torch_mode", "is_quantized", "is_quantized_layer_with_weight", "reduce_amax"]
