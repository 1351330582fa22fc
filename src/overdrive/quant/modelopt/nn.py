"""ModelOpt's ``modelopt.torch.quantization.nn``: the quantized layer classes, which are overdrive.quant's own, and
``TensorQuantizer`` (``from overdrive.quant.modelopt.nn import TensorQuantizer`` in place of
``from modelopt.torch.quantization.nn import TensorQuantizer``): overdrive.quant's quantizer built with ModelOpt's
arguments, and ``isinstance(module, TensorQuantizer)`` loops over a model that ``mtq.quantize`` quantized find every
quantizer; and ``QuantModuleRegistry``, where custom quantized classes are registered (``mtq.register``).

Example:
    >>> import torch
    >>> import overdrive.quant.modelopt as mtq
    >>> from overdrive.quant.modelopt.nn import TensorQuantizer
    >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG)
    >>> sorted(n for n, q in m.named_modules() if isinstance(q, TensorQuantizer))
    ['0.input_quantizer', '0.weight_quantizer']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.config import QuantConfig
from overdrive.quant.modules import (QuantConv1d, QuantConv2d, QuantConv3d, QuantConvTranspose1d, QuantConvTranspose2d,
                                     QuantConvTranspose3d, QuantLinear)
from overdrive.quant import quantizer as _quantizer
from overdrive.quant.config import QuantizerConfig


class _AnyTensorQuantizer(type(nn.Module)):
    """``isinstance(q, mtq.nn.TensorQuantizer)`` holds for every overdrive quantizer, also those that
    ``mtq.quantize`` placed, so ModelOpt scripts' loops over ``model.named_modules()`` reach all of them."""

    def __instancecheck__(cls, obj: object) -> bool:
        if cls is TensorQuantizer:
            return isinstance(obj, _quantizer.TensorQuantizer)
        return super().__instancecheck__(obj)


class TensorQuantizer(_quantizer.TensorQuantizer, metaclass=_AnyTensorQuantizer):
    """ModelOpt's ``TensorQuantizer(quant_attribute_cfg=None, if_quant=True, if_calib=False, amax=None)``: int8 per
    tensor by default; ``quant_attribute_cfg`` a ``QuantizerAttributeConfig`` or a dict of attributes
    (``num_bits`` 8 or (4, 3), ``axis`` of the tensor it quantizes, ``narrow_range``, ``enable``,
    ``calibrator``); ``amax`` a fixed amax; ``if_calib=True`` starts observing (``if_quant=False``: values pass
    through). overdrive's own form, ``TensorQuantizer(QuantizerConfig(...), axis=0)``, is taken too.

    Example:
        >>> import torch
        >>> from overdrive.quant.modelopt.config import QuantizerAttributeConfig
        >>> q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)), amax=448.0)
        >>> q.num_bits, q(torch.tensor([17.0])).item()  # fp8 e4m3 with scale 1: 17 rounds to 16
        ((4, 3), 16.0)
    """

    def __init__(self, quant_attribute_cfg: Any = None, *args: Any, **kwargs: Any) -> None:
        if isinstance(quant_attribute_cfg, QuantizerConfig):  # overdrive's own constructor
            super().__init__(quant_attribute_cfg, *args, **kwargs)
            return
        if_quant, if_calib, amax = _modelopt_args(*args, **kwargs)
        super().__init__()
        if quant_attribute_cfg is not None:
            self.set_from_attribute_config(quant_attribute_cfg)
        if amax is not None:
            self.amax = amax
        if not if_quant:
            self.disable_quant()
        if if_calib:
            self.enable_calib()


def _modelopt_args(if_quant: bool = True, if_calib: bool = False, amax: Any = None) -> tuple[bool, bool, Any]:
    """ModelOpt's TensorQuantizer arguments after ``quant_attribute_cfg`` (a TypeError names any other)."""
    return if_quant, if_calib, amax


class QuantModuleRegistryCls:
    """Custom quantized classes for ``mtq.quantize``: original class -> quantized class (ModelOpt's
    ``QuantModuleRegistry``). The quantized class has a ``_setup()`` that creates its quantizers
    (``self.input_quantizer = TensorQuantizer()``) and a forward that calls them; it may subclass the original
    class or not (then a class with both as bases is made, as ModelOpt does). ``mtq.quantize`` replaces every
    module whose type is registered (exactly, not subclasses) by an object of the quantized class that shares its
    parameters, buffers and submodules, calls ``_setup()``, then configures and calibrates its quantizers like the
    built-in layers'. A registration overrides the built-in class for that type (``nn.Linear`` too).

    The module-level :data:`QuantModuleRegistry` is what ``mtq.register`` / ``mtq.unregister`` fill: process-wide
    and filled only by the user, as in ModelOpt. Build your own ``QuantModuleRegistryCls()`` to keep one apart.

    Example:
        >>> import torch
        >>> class QuantLayerNorm(torch.nn.LayerNorm):
        ...     def _setup(self):
        ...         self.input_quantizer = TensorQuantizer()
        ...     def forward(self, x):
        ...         return super().forward(self.input_quantizer(x))
        >>> registry = QuantModuleRegistryCls()
        >>> _ = registry.register({torch.nn.LayerNorm: "nn.LayerNorm"})(QuantLayerNorm)
        >>> torch.nn.LayerNorm in registry, type(registry.convert(torch.nn.LayerNorm(4))).__name__
        (True, 'QuantLayerNorm')
    """

    def __init__(self) -> None:
        self._quantized: dict[type[nn.Module], type[nn.Module]] = {}  # original -> quantized class as registered
        self._made: dict[type[nn.Module], type[nn.Module]] = {}  # original -> class the module becomes

    def register(self, cls_to_key: Mapping[type[nn.Module], str]) -> Callable[[type[nn.Module]], type[nn.Module]]:
        """``QuantModuleRegistry.register({MyLayer: "MyLayer"})(QuantMyLayer)`` (also as a class decorator)."""
        if not isinstance(cls_to_key, Mapping) or not all(isinstance(c, type) and issubclass(c, nn.Module)
                                                          for c in cls_to_key):
            raise UsageError(f"register takes a dict {{OriginalClass: 'Name'}} of nn.Module classes; got {cls_to_key!r}")

        def decorator(quantized_cls: type[nn.Module]) -> type[nn.Module]:
            if not (isinstance(quantized_cls, type) and callable(getattr(quantized_cls, "_setup", None))):
                raise UsageError(f"{quantized_cls!r} must be a class with a _setup() method that creates its "
                                 "quantizers (self.input_quantizer = TensorQuantizer() ...)")
            for original in cls_to_key:
                if original in self._quantized:
                    raise UsageError(f"{original.__name__} is registered already (to "
                                     f"{self._quantized[original].__name__}); unregister it first: "
                                     f"mtq.unregister({original.__name__})")
                self._quantized[original] = quantized_cls
                self._made[original] = (quantized_cls if issubclass(quantized_cls, original) else
                                        type(quantized_cls)(quantized_cls.__name__, (quantized_cls, original),
                                                            {"__module__": quantized_cls.__module__}))
            return quantized_cls

        return decorator

    def unregister(self, original_cls: type[nn.Module]) -> None:
        """Forget the quantized class of ``original_cls`` (modules quantized before keep theirs)."""
        if original_cls not in self._quantized:
            raise UsageError(f"{getattr(original_cls, '__name__', original_cls)!r} is not registered; registered: "
                             f"{[c.__name__ for c in self._quantized]}")
        del self._quantized[original_cls], self._made[original_cls]

    def __contains__(self, cls: object) -> bool:
        return cls in self._quantized

    def __iter__(self) -> Iterator[type[nn.Module]]:
        return iter(list(self._quantized))

    def __len__(self) -> int:
        return len(self._quantized)

    def __getitem__(self, key: type[nn.Module] | str) -> type[nn.Module]:
        """The class a registered module becomes, by original class or its class name."""
        for original, made in self._made.items():
            if key is original or key == original.__name__:
                return made
        raise KeyError(f"{getattr(key, '__name__', key)!r} is not registered")

    def get(self, key: type[nn.Module] | str, default: type[nn.Module] | None = None) -> type[nn.Module] | None:
        try:
            return self[key]
        except KeyError:
            return default

    def convert(self, module: nn.Module) -> nn.Module:
        """A module of the quantized class sharing ``module``'s parameters, buffers, submodules and hooks, after
        ``_setup()``; ``module`` itself is not changed."""
        cls = self._made.get(type(module))
        if cls is None:
            raise UsageError(f"{type(module).__name__} is not registered; mtq.register(original_cls="
                             f"{type(module).__name__}, quantized_cls=...) first")
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)
        new._modules, new._parameters, new._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
        new._setup()  # type: ignore[operator]
        return new


QuantModuleRegistry = QuantModuleRegistryCls()
"""The registry ``mtq.register`` / ``mtq.unregister`` / ``mtq.quantize`` use (process-wide, user-filled)."""


class _InputQuantized:
    """A layer whose input only is quantized (ModelOpt's ``QuantInputBase``, which it puts on pooling layers)."""

    def _setup(self) -> None:
        self.input_quantizer = TensorQuantizer()

    def forward(self, input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002 - torch's name
        return super().forward(self.input_quantizer(input), *args, **kwargs)  # type: ignore[misc]


def _input_quantized(base: type[nn.Module]) -> type[nn.Module]:
    return type(f"Quant{base.__name__}", (_InputQuantized, base), {
        "__module__": __name__, "__doc__": f"``torch.nn.{base.__name__}`` with its input fake-quantized."})


_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
          nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
(QuantMaxPool1d, QuantMaxPool2d, QuantMaxPool3d, QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d, QuantAdaptiveAvgPool1d,
 QuantAdaptiveAvgPool2d, QuantAdaptiveAvgPool3d) = _QUANT_POOLS = tuple(_input_quantized(c) for c in _POOLS)

_BUILTIN = QuantModuleRegistryCls()  # ModelOpt's own registrations beyond quant.quantize's swaps
for _base, _quant in zip(_POOLS, _QUANT_POOLS):
    _BUILTIN.register({_base: f"nn.{_base.__name__}"})(_quant)


def convert_builtin(module: nn.Module) -> nn.Module | None:
    """The quantized form of a layer ModelOpt quantizes that ``quant.quantize`` leaves alone, else None:
    pooling layers (MaxPool / AvgPool / AdaptiveAvgPool 1d-3d) get an input quantizer, as ModelOpt's
    registry gives them (so its presets' ``*input_quantizer`` puts Q/DQ before them), and ConvTranspose1d / 3d
    are swapped like ConvTranspose2d (one with groups > 1 stays float, as a grouped ConvTranspose2d does:
    its output channels cannot get per-channel weight scales). ``module`` itself is not changed.

    Example:
        >>> import torch
        >>> pool = convert_builtin(torch.nn.MaxPool2d(2))
        >>> type(pool).__name__, type(pool.input_quantizer).__name__, convert_builtin(torch.nn.ReLU())
        ('QuantMaxPool2d', 'TensorQuantizer', None)
    """
    if type(module) in _BUILTIN:
        return _BUILTIN.convert(module)
    transposed = {nn.ConvTranspose1d: QuantConvTranspose1d, nn.ConvTranspose3d: QuantConvTranspose3d}.get(type(module))
    if transposed is not None and module.groups == 1:  # type: ignore[union-attr]
        return transposed.from_float(module, QuantConfig())  # quantizers set by the config's entries after
    return None


__all__ = ["TensorQuantizer", "QuantLinear", "QuantConv1d", "QuantConv2d", "QuantConv3d", "QuantConvTranspose1d",
           "QuantConvTranspose2d", "QuantConvTranspose3d", "QuantMaxPool1d", "QuantMaxPool2d", "QuantMaxPool3d",
           "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d", "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d",
           "QuantAdaptiveAvgPool3d", "QuantModuleRegistry", "QuantModuleRegistryCls", "convert_builtin"]
