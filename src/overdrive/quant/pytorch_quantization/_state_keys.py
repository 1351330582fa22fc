"""pytorch-quantization's checkpoint key names for the face's layers and quantizers.

pytorch-quantization saves a layer's quantizers as ``<layer>._input_quantizer._amax`` and
``<layer>._weight_quantizer._amax``, a per-channel amax in the keep-dims shape of the tensor it quantizes
((C, 1) for a Linear weight, (C, 1, 1, 1) for a Conv2d one, (1, C, 1, 1) for a ConvTranspose2d one). The face's
classes (``quant_nn.QuantLinear``, ``quant_nn.TensorQuantizer``, ...) are subclasses of overdrive.quant's, so
they write those names through two class-level overrides, while overdrive.quant's own layers (those
``quant.quantize`` swaps in) keep ``<layer>.input_quantizer.amax`` with a (C,) amax. Both forms load into
both kinds of model (the loaders rename ``_input_quantizer`` / ``_amax`` and flatten keep-dims amax).

Only the keys change: the modules stay ``input_quantizer`` / ``weight_quantizer`` in ``named_modules()``
(``_input_quantizer`` / ``_weight_quantizer`` are properties returning them).

Example:
    >>> import torch
    >>> from overdrive.quant.pytorch_quantization import nn as quant_nn
    >>> fc = quant_nn.QuantLinear(4, 3)
    >>> fc.input_quantizer.amax = torch.tensor(2.0); fc.weight_quantizer.amax = torch.ones(3)
    >>> {k: tuple(v.shape) for k, v in fc.state_dict().items() if "quantizer" in k}
    {'_input_quantizer._amax': (), '_weight_quantizer._amax': (3, 1)}
"""

from __future__ import annotations

import itertools
from collections.abc import MutableMapping
from typing import Any

import torch

# overdrive.quant's child names -> pytorch-quantization's, as key prefixes under a layer
_CHILD_NAMES = (("input_quantizer.", "_input_quantizer."), ("weight_quantizer.", "_weight_quantizer."))


def keepdims_amax(amax: torch.Tensor, axis: int | None, ndim: int | None) -> torch.Tensor:
    """A (C,) per-channel ``amax`` reshaped to pytorch-quantization's keep-dims shape for a tensor of ``ndim``
    dimensions quantized along ``axis``; any other amax (per tensor, ndim unknown) is returned as is.

    Example:
        >>> keepdims_amax(torch.ones(4), 1, 4).shape, keepdims_amax(torch.tensor(1.0), None, 2).shape
        (torch.Size([1, 4, 1, 1]), torch.Size([]))
    """
    if axis is None or ndim is None or amax.dim() != 1 or not 0 <= axis < ndim:
        return amax
    shape = [1] * ndim
    shape[axis] = amax.numel()
    return amax.reshape(shape)


def save_quantizer_amax(quantizer: torch.nn.Module, destination: MutableMapping[str, Any], prefix: str,
                        keep_vars: bool) -> None:
    """Rename the ``amax`` buffer just saved under ``prefix`` to ``_amax``, in the keep-dims shape (with
    ``keep_vars`` the buffer itself, unreshaped: tracing (``torch.jit``, ``torch.onnx``) maps the values of
    ``state_dict(keep_vars=True)`` back to the module's tensors by identity)."""
    if prefix + "amax" not in destination:
        return
    amax = destination.pop(prefix + "amax")
    if not keep_vars:
        amax = keepdims_amax(amax, quantizer.__dict__.get("_channel_axis"), quantizer.__dict__.get("_keepdims_ndim"))
    destination[prefix + "_amax"] = amax


def note_weight_ndim(quantizer: torch.nn.Module, weight: object) -> None:
    """Remember the number of dimensions of the weight ``quantizer`` quantizes, for the keep-dims amax shape."""
    if isinstance(weight, torch.Tensor):
        quantizer.__dict__["_keepdims_ndim"] = weight.dim()


class OriginalKeys:
    """Mixin for the face's layers: ``state_dict`` names the quantizers ``_input_quantizer`` /
    ``_weight_quantizer``, as pytorch-quantization's layers (whose attributes have those names) do.

    A class-level override rather than a hook registered per instance, so it also holds for layers that scripts
    build with ``QuantConv2d.__new__`` and a copied ``__dict__`` (which would share the float layer's hook dict)."""

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        # torch's signature: state_dict(*, destination=None, prefix="", keep_vars=False), positional deprecated
        destination = kwargs.get("destination", args[0] if args else None)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        before = len(destination) if destination is not None else 0
        out = super().state_dict(*args, **kwargs)  # type: ignore[misc]
        added = len(out) - before
        # this layer's keys are the last ones added: walk back over them only (no scan of the whole model's)
        mine = list(itertools.islice(reversed(out), added))[::-1] if 0 <= added <= len(out) else list(out)
        for key in mine:
            for native, original in _CHILD_NAMES:
                if key.startswith(prefix + native):
                    out[prefix + original + key[len(prefix + native):]] = out.pop(key)
                    break
            else:
                out[key] = out.pop(key)  # keep the layer's keys in order (the renamed ones moved to the end)
        return out


__all__ = ["keepdims_amax", "save_quantizer_amax", "note_weight_ndim", "OriginalKeys"]
