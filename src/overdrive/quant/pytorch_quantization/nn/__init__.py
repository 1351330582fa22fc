"""pytorch-quantization's ``nn``: ``TensorQuantizer`` and the quantized layers, built from QuantDescriptors.

The layers subclass overdrive.quant's (``QuantLinear`` here is a ``quant.QuantLinear``), so their quantizers
are ``input_quantizer`` / ``weight_quantizer``; ``_input_quantizer`` / ``_weight_quantizer`` are the same
objects under pytorch-quantization's names. Their ``state_dict`` keys are pytorch-quantization's
(``fc._input_quantizer._amax``, a per-channel amax in keep-dims shape), and they load those keys or
overdrive.quant's (``fc.input_quantizer.amax``) alike.

Example:
    >>> import torch
    >>> conv = QuantConv2d(3, 8, 3, padding=1)
    >>> type(conv._weight_quantizer._calibrator).__name__, conv._weight_quantizer.axis
    ('MaxCalibrator', (0,))
"""

from __future__ import annotations

from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant.calibrators import MODELOPT_MAX_BINS_FACTOR
from overdrive.quant import modules as _modules
from overdrive.quant import quantizer as _quantizer
from overdrive.quant.pytorch_quantization._state_keys import OriginalKeys, note_weight_ndim, save_quantizer_amax
from overdrive.quant.pytorch_quantization.tensor_quant import (
    QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW,
    QUANT_DESC_8BIT_PER_TENSOR,
    QuantDescriptor,
    _Axis,
)


class _AnyTensorQuantizer(type(torch.nn.Module)):
    """``isinstance(q, quant_nn.TensorQuantizer)`` holds for every overdrive quantizer, also those that
    ``overdrive.quant.quantize`` placed, so the TensorRT samples' loops reach all of them."""

    def __instancecheck__(cls, obj: object) -> bool:
        if cls is TensorQuantizer:
            return isinstance(obj, _quantizer.TensorQuantizer)
        return super().__instancecheck__(obj)


class TensorQuantizer(_quantizer.TensorQuantizer, metaclass=_AnyTensorQuantizer):
    """overdrive.quant's TensorQuantizer built from a QuantDescriptor, with pytorch-quantization's flags.

    ``_calibrator`` is made with the quantizer (MaxCalibrator, or HistogramCalibrator for
    ``calib_method="histogram"``); ``enable_calib`` / ``disable_quant`` / ``load_calib_amax`` are
    overdrive.quant's own methods. While calibrating, values pass through unquantized.

    ``use_fb_fake_quant``: pytorch-quantization's switch to torch's fake-quant ops, which its users set on the
    class around ``torch.onnx.export``. As there, it quantizes int8 to the full range [-128, 127] even for a
    ``narrow_range=True`` descriptor (torch's ``fake_quantize_per_*_affine``, which export writes as
    QuantizeLinear / DequantizeLinear pairs), in eager outputs and in the exported graph alike; off, a narrow
    range is [-127, 127].
    """

    use_fb_fake_quant: bool = False

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:  # noqa: ANN001
        # pytorch-quantization's buffer name and shape: ``_amax``, per channel in keep-dims shape
        super()._save_to_state_dict(destination, prefix, keep_vars)
        save_quantizer_amax(self, destination, prefix, keep_vars)

    def __init__(self, quant_desc: QuantDescriptor = QUANT_DESC_8BIT_PER_TENSOR, disabled: bool = False,
                 if_quant: bool = True, if_calib: bool = False) -> None:
        if not isinstance(quant_desc, QuantDescriptor):
            raise UsageError(f"quant_desc must be a QuantDescriptor, got {type(quant_desc).__name__}")
        super().__init__(quant_desc.quantizer_config(), axis=quant_desc.per_channel_axis,
                         histogram=quant_desc.calib_method == "histogram")
        self.hist_max_bins = MODELOPT_MAX_BINS_FACTOR * self.num_bins  # pytorch-quantization's bins never coarsen
        self.calibrator = self.new_calibrator()
        if quant_desc.amax is not None:
            self.set_amax(torch.tensor(quant_desc.amax))
        if disabled:
            self.disable()
        if not if_quant:
            self.disable_quant()
        if if_calib:
            self.enable_calib()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As overdrive.quant's quantizer; one with no amax (never calibrated: a layer built by hand, a weight
        quantizer the calibration loop skipped) quantizes with the current tensor's own max, per tensor or per
        channel along its axis, as pytorch-quantization's ``TensorQuantizer`` does, instead of raising."""
        if (self.amax is not None or not self.enabled or self.calibrating or not self.quant_enabled or self.dynamic):
            return super().forward(x)
        if torch.onnx.is_in_onnx_export() and not isinstance(x, torch.nn.Parameter):
            # the scale would be the example input's max (a constant in a TorchScript graph, data-dependent ops
            # in a torch.export one): wrong for every other input, and no static Q/DQ for TensorRT
            raise UsageError(
                f"activation quantizer {self.name or '(unnamed)'} was never calibrated (it has no amax), so "
                "exporting it would bake the example input's max as its scale; calibrate the model first (enable_calib"
                " / forward passes / load_calib_amax), set its amax (q.amax = 2.5), or disable() it to keep that "
                "input in float")
        x = self.apply_pre_quant_scale(x)
        xf = x.float()
        ax = self.__dict__.get("_channel_axis")  # the per-channel axis (see ``axis``), None per tensor
        dims = [d for d in range(xf.dim()) if d != ax] if ax is not None else list(range(xf.dim()))
        amax = xf.detach().abs().amax(dim=dims) if dims else xf.detach().abs()
        scale = amax.clamp_min(_quantizer._TINY_AMAX) / self.config.bound
        out = self._fake_quant(xf, scale, amax)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _fake_quant(self, xf: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        if self.use_fb_fake_quant and self.config.narrow_range and self.config.format == "int8":
            # pytorch-quantization's _fb_fake_quant: torch's fake quantization with quant_min -128 whatever the
            # descriptor's narrow_range (what TensorRT's Q/DQ export gets)
            narrow = self.config
            object.__setattr__(self, "config", narrow.replace(narrow_range=False))
            try:
                return super()._fake_quant(xf, scale, amax)
            finally:
                object.__setattr__(self, "config", narrow)
        return super()._fake_quant(xf, scale, amax)

    @property  # type: ignore[override]
    def axis(self) -> int | None:
        """The per-channel axis as pytorch-quantization gives it back: equal to ``(0,)`` (the descriptor's
        tuple) and to ``0``, indexable and iterable as the tuple (None: per tensor)."""
        axis = self.__dict__.get("_channel_axis")
        return None if axis is None else _Axis(axis)

    @axis.setter
    def axis(self, value: int | tuple[int, ...] | None) -> None:
        if isinstance(value, (tuple, list)):
            if len(value) != 1:
                raise UsageError(f"axis={value!r}: one per-channel axis at most, e.g. (0,)")
            value = value[0]
        self.__dict__["_channel_axis"] = None if value is None else int(value)


_ALIASES = {"_input_quantizer": "input_quantizer", "_weight_quantizer": "weight_quantizer"}


class _QuantDescLayer(OriginalKeys):
    """pytorch-quantization's layer constructor: the float layer's arguments plus ``quant_desc_input`` /
    ``quant_desc_weight`` (default: the class's defaults, changed with ``set_default_quant_desc_*``)."""

    default_quant_desc_input: QuantDescriptor = QUANT_DESC_8BIT_PER_TENSOR
    default_quant_desc_weight: QuantDescriptor = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    weight_axis: int

    def __init__(self, *args: Any, quant_desc_input: QuantDescriptor | None = None,
                 quant_desc_weight: QuantDescriptor | None = None, **kwargs: Any) -> None:
        # the float class in the MRO (bound when the class was made: torch.nn.Linear may be rebound by initialize())
        base = next(b for b in type(self).__mro__ if b.__module__.startswith("torch.nn"))
        base.__init__(self, *args, **kwargs)
        self.init_quantizer(quant_desc_input or type(self).default_quant_desc_input,
                            quant_desc_weight or type(self).default_quant_desc_weight)

    def init_quantizer(self, quant_desc_input: QuantDescriptor, quant_desc_weight: QuantDescriptor) -> None:
        """(Re)create ``input_quantizer`` / ``weight_quantizer`` (``_input_quantizer`` / ``_weight_quantizer``)
        from the descriptors: pytorch-quantization's ``QuantMixin.init_quantizer``, which scripts that build a
        layer with ``QuantConv2d.__new__`` and copy a float conv's attributes call themselves."""
        din, dw = quant_desc_input, quant_desc_weight
        for d, what in ((din, "quant_desc_input"), (dw, "quant_desc_weight")):
            if not isinstance(d, QuantDescriptor):
                raise UsageError(f"{type(self).__name__}: {what} must be a QuantDescriptor, got {type(d).__name__}")
        if din.axis is not None:
            raise UsageError(f"{type(self).__name__}: quant_desc_input axis={din.axis} is not supported; layer "
                             "inputs are quantized per tensor (axis=None)")
        if dw.axis is not None and dw.per_channel_axis != self.weight_axis:
            raise UsageError(f"{type(self).__name__}: quant_desc_weight axis={dw.axis} is not supported; weights "
                             f"are per output channel along axis ({self.weight_axis},) or per tensor (axis=None)")
        if dw.axis is not None and self.weight_axis == 1 and getattr(self, "groups", 1) > 1:
            raise UsageError(f"{type(self).__name__} with groups={self.groups}: per-output-channel weight scales "
                             "cannot be expressed for a grouped transposed convolution (its weight is (C_in, "
                             "C_out/groups, ...)); use a per-tensor quant_desc_weight (axis=None)")
        self.input_quantizer = TensorQuantizer(din)
        self.weight_quantizer = TensorQuantizer(dw)
        note_weight_ndim(self.weight_quantizer, getattr(self, "weight", None))

    @classmethod
    def set_default_quant_desc_input(cls, value: QuantDescriptor) -> None:
        """Quantize the inputs of every layer of this class built from now on with ``value``."""
        if not isinstance(value, QuantDescriptor):
            raise UsageError(f"expected a QuantDescriptor, got {type(value).__name__}")
        cls.default_quant_desc_input = value

    @classmethod
    def set_default_quant_desc_weight(cls, value: QuantDescriptor) -> None:
        """Quantize the weights of every layer of this class built from now on with ``value``."""
        if not isinstance(value, QuantDescriptor):
            raise UsageError(f"expected a QuantDescriptor, got {type(value).__name__}")
        cls.default_quant_desc_weight = value

    def __setattr__(self, name: str, value: Any) -> None:
        # ``layer._input_quantizer = other._input_quantizer`` (YOLOv7's QAT rules share one quantizer between the
        # inputs of a concat) sets the quantizer the layer runs, not a third module beside it
        super().__setattr__(_ALIASES.get(name, name), value)

    @property
    def _input_quantizer(self) -> _quantizer.TensorQuantizer:
        return self.input_quantizer  # type: ignore[attr-defined]

    @property
    def _weight_quantizer(self) -> _quantizer.TensorQuantizer:
        return self.weight_quantizer  # type: ignore[attr-defined]


class QuantLinear(_QuantDescLayer, _modules.QuantLinear):
    default_quant_desc_weight = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW


class QuantConv1d(_QuantDescLayer, _modules.QuantConv1d):
    default_quant_desc_weight = QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL


class QuantConv2d(_QuantDescLayer, _modules.QuantConv2d):
    default_quant_desc_weight = QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL


class QuantConv3d(_QuantDescLayer, _modules.QuantConv3d):
    default_quant_desc_weight = QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL


class QuantConvTranspose1d(_QuantDescLayer, _modules.QuantConvTranspose1d):
    default_quant_desc_weight = QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL


class QuantConvTranspose2d(_QuantDescLayer, _modules.QuantConvTranspose2d):
    default_quant_desc_weight = QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL


class QuantConvTranspose3d(_QuantDescLayer, _modules.QuantConvTranspose3d):
    default_quant_desc_weight = QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL


class _QuantInputLayer(OriginalKeys):
    """pytorch-quantization's pooling layers: the float layer's arguments plus ``quant_desc_input``; the input is
    fake-quantized by ``input_quantizer`` (``_input_quantizer``), then pooled by the float layer's forward."""

    default_quant_desc_input: QuantDescriptor = QUANT_DESC_8BIT_PER_TENSOR
    _float_class: type[torch.nn.Module]

    def __init__(self, *args: Any, quant_desc_input: QuantDescriptor | None = None, **kwargs: Any) -> None:
        self._float_class.__init__(self, *args, **kwargs)
        self.init_quantizer(quant_desc_input or type(self).default_quant_desc_input)

    def init_quantizer(self, quant_desc_input: QuantDescriptor) -> None:
        """(Re)create ``input_quantizer`` (``_input_quantizer``): pytorch-quantization's
        ``QuantInputMixin.init_quantizer``."""
        din = quant_desc_input
        if not isinstance(din, QuantDescriptor):
            raise UsageError(f"{type(self).__name__}: quant_desc_input must be a QuantDescriptor, got "
                             f"{type(din).__name__}")
        if din.axis is not None:
            raise UsageError(f"{type(self).__name__}: quant_desc_input axis={din.axis} is not supported; pooling "
                             "inputs are quantized per tensor (axis=None)")
        self.input_quantizer = TensorQuantizer(din)

    @classmethod
    def set_default_quant_desc_input(cls, value: QuantDescriptor) -> None:
        """Quantize the inputs of every layer of this class built from now on with ``value``."""
        if not isinstance(value, QuantDescriptor):
            raise UsageError(f"expected a QuantDescriptor, got {type(value).__name__}")
        cls.default_quant_desc_input = value

    _input_quantizer = _QuantDescLayer._input_quantizer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._float_class.forward(self, self.input_quantizer(input))

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(_ALIASES.get(name, name), value)  # as _QuantDescLayer's

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        _modules.rename_legacy_quantizer_keys(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]


def _pool(name: str) -> type:
    base = getattr(torch.nn, name)
    return type(f"Quant{name}", (_QuantInputLayer, base), {
        "__module__": __name__, "_float_class": base,
        "__doc__": f"``torch.nn.{name}`` with its input fake-quantized (pytorch-quantization's)."})


QuantMaxPool1d, QuantMaxPool2d, QuantMaxPool3d = (_pool(f"MaxPool{d}d") for d in (1, 2, 3))
QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d = (_pool(f"AvgPool{d}d") for d in (1, 2, 3))
QuantAdaptiveAvgPool1d, QuantAdaptiveAvgPool2d, QuantAdaptiveAvgPool3d = (_pool(f"AdaptiveAvgPool{d}d")
                                                                          for d in (1, 2, 3))

# pytorch-quantization's aliases without the Quant prefix (its docs build layers as ``quant_nn.Conv2d(...)``,
# ``quant_nn.Linear(...)``, ``quant_nn.MaxPool2d(...)``): the same classes
Linear = QuantLinear
Conv1d, Conv2d, Conv3d = QuantConv1d, QuantConv2d, QuantConv3d
ConvTranspose1d, ConvTranspose2d, ConvTranspose3d = QuantConvTranspose1d, QuantConvTranspose2d, QuantConvTranspose3d
MaxPool1d, MaxPool2d, MaxPool3d = QuantMaxPool1d, QuantMaxPool2d, QuantMaxPool3d
AvgPool1d, AvgPool2d, AvgPool3d = QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d
AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = QuantAdaptiveAvgPool1d, QuantAdaptiveAvgPool2d, QuantAdaptiveAvgPool3d

_MISSING = {
    **{n: "recurrent layers are not quantized by overdrive.quant; keep the LSTM in float (build it with "
          "quant_modules.initialize(float_module_list=...) not covering it, or before initialize())"
       for n in ("QuantLSTM", "QuantLSTMCell", "QuantRNN", "QuantGRU", "LSTM", "LSTMCell")},
    **{n: "quantized instance norm is not in overdrive.quant; keep the norm in float"
       for n in ("QuantInstanceNorm1d", "QuantInstanceNorm2d", "QuantInstanceNorm3d", "InstanceNorm1d",
                 "InstanceNorm2d", "InstanceNorm3d")},
    "Clip": "learned clipping (learn_amax) is not supported: amax stays fixed in QAT",
}


def __getattr__(name: str) -> Any:
    if name in _MISSING:
        raise AttributeError(f"quant_nn.{name} is not available in overdrive.quant.pytorch_quantization: "
                             f"{_MISSING[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TensorQuantizer", "QuantLinear", "QuantConv1d", "QuantConv2d", "QuantConv3d", "QuantConvTranspose1d",
           "QuantConvTranspose2d", "QuantConvTranspose3d", "modules",
           "QuantMaxPool1d", "QuantMaxPool2d", "QuantMaxPool3d", "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d",
           "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d", "QuantAdaptiveAvgPool3d",
           "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
           "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d"]

from overdrive.quant.pytorch_quantization.nn import modules  # noqa: E402  (quant_nn.modules._utils; needs the classes above)
from overdrive.quant.pytorch_quantization.nn.modules import _utils  # noqa: E402, F401
