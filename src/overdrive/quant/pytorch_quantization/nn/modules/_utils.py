"""pytorch-quantization's ``nn.modules._utils``: ``QuantMixin`` / ``QuantInputMixin`` and
``pop_quant_desc_in_kwargs``, for writing custom quantized modules as pytorch-quantization's docs do
(``from pytorch_quantization.nn.modules import _utils as quant_nn_utils`` ->
``from overdrive.quant.pytorch_quantization.nn.modules import _utils as quant_nn_utils``).

``init_quantizer`` makes ``_input_quantizer`` (and ``_weight_quantizer``) from QuantDescriptors, under
pytorch-quantization's names, so the state_dict keys are theirs (``_input_quantizer._amax``, a per-channel weight
amax in the weight's keep-dims shape); ``input_quantizer`` / ``weight_quantizer`` read them.
``isinstance(layer, QuantMixin)`` also holds for every quantized layer of overdrive.quant (``quant_nn.QuantConv2d``,
layers quantize() swapped), and ``isinstance(pool, QuantInputMixin)`` for ``quant_nn.QuantMaxPool2d`` etc.: their
``init_quantizer`` (re)creates their quantizers, which is what the YOLO / PointPillars QAT scripts'
``transfer_torch_to_quantization`` calls on ``QuantConv2d.__new__(QuantConv2d)``. The quantizers are calibrated by
``quant.calibrate(model, forward_loop)`` or the TensorRT samples' ``enable_calib`` / ``load_calib_amax`` loop; a custom
module's weight quantizer is calibrated on the weight its forward passes it, as in pytorch-quantization.

Example:
    >>> import torch, torch.nn.functional as F
    >>> from overdrive.quant.pytorch_quantization.nn.modules import _utils as quant_nn_utils
    >>> class QuantBilinear(torch.nn.Bilinear, quant_nn_utils.QuantMixin):
    ...     def __init__(self, n1, n2, out, **kwargs):
    ...         super().__init__(n1, n2, out)
    ...         self.init_quantizer(*quant_nn_utils.pop_quant_desc_in_kwargs(self.__class__, **kwargs))
    ...     def forward(self, a, b):
    ...         w = self._weight_quantizer(self.weight)
    ...         return F.bilinear(self._input_quantizer(a), self._input_quantizer(b), w, self.bias)
    >>> layer = QuantBilinear(3, 3, 2)
    >>> sorted(n for n, _ in layer.named_children()), isinstance(layer, quant_nn_utils.QuantMixin)
    (['_input_quantizer', '_weight_quantizer'], True)
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.pytorch_quantization._state_keys import note_weight_ndim
from overdrive.quant.pytorch_quantization.tensor_quant import QUANT_DESC_8BIT_PER_TENSOR, QuantDescriptor


class _CountsOverdriveLayers(type):
    """``isinstance(layer, QuantMixin)`` holds for overdrive.quant's quantized layers too (and
    ``QuantInputMixin`` for the pooling layers), which keep their quantizers under their own names."""

    def __instancecheck__(cls, obj: object) -> bool:
        if super().__instancecheck__(obj):
            return True
        if cls is QuantMixin:
            from overdrive.quant.modules import _QuantMixin

            return isinstance(obj, _QuantMixin)
        if cls is QuantInputMixin:
            from overdrive.quant.pytorch_quantization.nn import _QuantInputLayer

            return isinstance(obj, _QuantInputLayer)
        return False


def _check_desc(value: object, what: str) -> QuantDescriptor:
    if not isinstance(value, QuantDescriptor):
        raise UsageError(f"{what} must be a QuantDescriptor (tensor_quant.QuantDescriptor(num_bits=8, axis=...)), "
                         f"got {type(value).__name__}")
    return value


def _quantizer(desc: QuantDescriptor) -> nn.Module:
    from overdrive.quant.pytorch_quantization.nn import TensorQuantizer

    return TensorQuantizer(desc)


class QuantMixin(metaclass=_CountsOverdriveLayers):
    """Input and weight quantizers for a custom quantized module (pytorch-quantization's ``QuantMixin``): subclass
    it beside the float module, call ``self.init_quantizer(quant_desc_input, quant_desc_weight)`` in ``__init__``
    and ``self._input_quantizer(x)`` / ``self._weight_quantizer(self.weight)`` in ``forward``."""

    default_quant_desc_input: QuantDescriptor = QUANT_DESC_8BIT_PER_TENSOR
    default_quant_desc_weight: QuantDescriptor = QUANT_DESC_8BIT_PER_TENSOR

    @classmethod
    def set_default_quant_desc_input(cls, value: QuantDescriptor) -> None:
        """Quantize the inputs of every module of this class built from now on with ``value``."""
        cls.default_quant_desc_input = copy.deepcopy(_check_desc(value, "quant_desc_input"))

    @classmethod
    def set_default_quant_desc_weight(cls, value: QuantDescriptor) -> None:
        """Quantize the weights of every module of this class built from now on with ``value``."""
        cls.default_quant_desc_weight = copy.deepcopy(_check_desc(value, "quant_desc_weight"))

    def init_quantizer(self, quant_desc_input: QuantDescriptor, quant_desc_weight: QuantDescriptor,
                       num_layers: int | None = None) -> None:
        """``self._input_quantizer`` / ``self._weight_quantizer`` from the descriptors (``num_layers``: ModuleLists
        ``_input_quantizers`` / ``_weight_quantizers`` of that many)."""
        din = _check_desc(quant_desc_input, "quant_desc_input")
        dw = _check_desc(quant_desc_weight, "quant_desc_weight")
        self._fake_quant = True
        if num_layers is None:
            self._input_quantizer = _quantizer(din)
            self._weight_quantizer = _quantizer(dw)
            note_weight_ndim(self._weight_quantizer, getattr(self, "weight", None))
        else:
            self._input_quantizers = nn.ModuleList([_quantizer(din) for _ in range(num_layers)])
            self._weight_quantizers = nn.ModuleList([_quantizer(dw) for _ in range(num_layers)])

    @property
    def input_quantizer(self) -> nn.Module:
        return self._input_quantizer  # type: ignore[attr-defined]

    @property
    def weight_quantizer(self) -> nn.Module:
        return self._weight_quantizer  # type: ignore[attr-defined]


class QuantInputMixin(metaclass=_CountsOverdriveLayers):
    """An input quantizer for a custom quantized module (pytorch-quantization's ``QuantInputMixin``): call
    ``self.init_quantizer(quant_desc_input)`` in ``__init__`` and ``self._input_quantizer(x)`` in ``forward``."""

    default_quant_desc_input: QuantDescriptor = QUANT_DESC_8BIT_PER_TENSOR

    set_default_quant_desc_input = QuantMixin.set_default_quant_desc_input

    def init_quantizer(self, quant_desc_input: QuantDescriptor) -> None:
        """``self._input_quantizer`` from the descriptor."""
        self._fake_quant = True
        self._input_quantizer = _quantizer(_check_desc(quant_desc_input, "quant_desc_input"))

    input_quantizer = QuantMixin.input_quantizer


def pop_quant_desc_in_kwargs(quant_cls: type, input_only: bool = False,
                             **kwargs: Any) -> QuantDescriptor | tuple[QuantDescriptor, QuantDescriptor]:
    """``quant_desc_input`` (and ``quant_desc_weight`` unless ``input_only``) from ``kwargs``, else the class's
    defaults; any other keyword is an error (a misspelt descriptor name would otherwise pass unnoticed).

    Example:
        >>> from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor
        >>> din, dw = pop_quant_desc_in_kwargs(QuantMixin, quant_desc_weight=QuantDescriptor(axis=(0,)))
        >>> din.axis, dw.axis
        (None, (0,))
    """
    quant_desc_input = kwargs.pop("quant_desc_input", quant_cls.default_quant_desc_input)
    quant_desc_weight = None if input_only else kwargs.pop("quant_desc_weight", quant_cls.default_quant_desc_weight)
    if kwargs:
        raise UsageError(f"unused keyword argument(s) {sorted(kwargs)}; a quantized module takes quant_desc_input"
                         + ("" if input_only else " and quant_desc_weight"))
    return quant_desc_input if input_only else (quant_desc_input, quant_desc_weight)


__all__ = ["QuantMixin", "QuantInputMixin", "pop_quant_desc_in_kwargs"]
