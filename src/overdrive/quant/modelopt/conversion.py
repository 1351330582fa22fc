"""ModelOpt's ``modelopt.torch.quantization.conversion``: how a config's attributes become quantizer settings
(:func:`set_quantizer_by_cfg`, :func:`set_quantizer_attribute`), custom quantized classes (:func:`register`) and
the layer swap ``mtq.quantize`` starts with.

Example:
    >>> import torch, overdrive.quant.modelopt as mtq
    >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG,
    ...                  lambda m: m(torch.randn(8, 4)))
    >>> mtq.set_quantizer_attribute(m, "*input_quantizer", {"enable": False})
    >>> m[0].input_quantizer.enabled
    False
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant import api
from overdrive.quant.calibrators import MODELOPT_MAX_BINS_FACTOR
from overdrive.quant.config import QuantConfig, QuantizerConfig
from overdrive.quant.modelopt.quant_cfg import Rule, rules
from overdrive.quant.modules import _QuantMixin
from overdrive.quant.quantizer import TensorQuantizer

_ATTRS = ("enable", "num_bits", "axis", "narrow_range", "unsigned", "fake_quant", "trt_high_precision_dtype",
          "calibrator")
# ModelOpt attributes accepted at their default value only (what a config that spells out every default has)
_DEFAULT_ONLY = {"type": "static", "bias": None, "learn_amax": False, "rotate": False, "pass_through_bwd": True,
                 "use_constant_amax": False, "backend": None, "backend_extra_args": None}



def _check_entry(pattern: str, attrs: Any, where: str | None = None) -> dict[str, Any]:
    """The supported attributes of one entry (num_bits as 8 or (4, 3)); a UsageError names any other (and
    ``where`` it came from: quant_cfg[pattern] unless given)."""
    if not isinstance(attrs, Mapping):
        raise UsageError(f"quant_cfg[{pattern!r}] = {attrs!r} must be a dict of quantizer attributes, e.g. "
                         '{"num_bits": 8, "axis": None} or {"enable": False}')
    if where is None:
        where = pattern if pattern.startswith("quant_cfg[") else f"quant_cfg[{pattern!r}]"
    if attrs.get("block_sizes") is not None:
        raise UsageError(f"{where} has block_sizes (block-wise / int4 quantization), which "
                         "overdrive.quant does not fake-quantize; for grouped 4- or 8-bit weights use "
                         "quant.weight_only(model, bits=4, group_size=128)")
    bad = [k for k in attrs if k not in _ATTRS and k not in _DEFAULT_ONLY and k not in ("block_sizes", "effective_bits")]
    if bad:
        raise UsageError(f"{where} has unsupported attribute(s) {bad}; supported: {list(_ATTRS)}")
    off_default = [f"{k}={attrs[k]!r}" for k in _DEFAULT_ONLY if k in attrs and attrs[k] != _DEFAULT_ONLY[k]]
    if off_default:
        raise UsageError(f"{where} sets {', '.join(off_default)}, which mtq does not support; drop it (supported "
                         f"only at the default: {_DEFAULT_ONLY})")
    out = {k: v for k, v in attrs.items() if k in _ATTRS}
    if "num_bits" in out:
        bits = out["num_bits"]
        out["num_bits"] = (4, 3) if isinstance(bits, str) and bits.lower() == "e4m3" else (
            tuple(bits) if isinstance(bits, list) else bits)
    return out


_FRESH = {"enable": True, "num_bits": 8, "axis": None, "narrow_range": False, "calibrator": "max"}  # a quantizer ModelOpt just inserted


def _resolve(name: str, owner: torch.nn.Module, quant_rules: list[Rule],
             start: Mapping[str, Any] = _FRESH) -> dict[str, Any]:
    """The attributes ModelOpt would give the quantizer ``name`` (owned by ``owner``): ``start`` (a fresh
    quantizer's, or its current ones), then every matching entry in order. An entry with ``cfg`` replaces the
    attributes (what it leaves out takes a fresh quantizer's value) and turns the quantizer on unless its
    ``enable`` says otherwise; an entry without ``cfg`` only switches it on or off."""
    attrs: dict[str, Any] = dict(start)
    for rule in quant_rules:
        if rule.matches(name, owner):
            if rule.cfg is None:
                attrs["enable"] = rule.enable
            else:
                attrs = {**_FRESH, **_check_entry(rule.label, rule.cfg), "enable": rule.enable}
    return attrs


def _quantizer_config(name: str, attrs: dict[str, Any], weight_axis: int | None) -> tuple[QuantizerConfig, bool]:
    """(QuantizerConfig, per_channel) for ModelOpt attributes; ``weight_axis`` None for activation quantizers."""
    bits = attrs["num_bits"]
    bits = tuple(bits) if isinstance(bits, list) else bits
    fmt = {8: "int8", (4, 3): "fp8_e4m3"}.get(bits) if isinstance(bits, (int, tuple)) else None
    if fmt is None:
        raise UsageError(f"{name}: num_bits={bits!r} is not supported; use 8 (int8) or (4, 3) (fp8 e4m3); for 4-bit "
                         "weights use quant.weight_only(model, bits=4)")
    if attrs.get("unsigned"):
        raise UsageError(f"{name}: unsigned=True is not supported; overdrive.quant quantizes symmetrically (zero point 0)")
    calibrator = attrs.get("calibrator", "max")
    if calibrator not in ("max", "histogram"):
        raise UsageError(f"{name}: calibrator={calibrator!r} is not supported; use 'max' or 'histogram' (a "
                         "calibrator class or (class, args) pair is not)")
    if calibrator == "histogram" and (weight_axis is not None or attrs["axis"] is not None):
        raise UsageError(f"{name}: calibrator='histogram' collects a per-tensor histogram of activations (as "
                         "ModelOpt's HistogramCalibrator, which refuses an axis); weights are calibrated with max "
                         "|w|: drop 'calibrator' from the weight quantizers' cfg")
    if attrs.get("fake_quant") is False:
        raise UsageError(f"{name}: fake_quant=False (real low precision) is quant.to_real(model) after quantize()")
    axis = attrs["axis"]
    axis = axis[0] if isinstance(axis, (tuple, list)) and len(axis) == 1 else axis
    if axis is not None and axis != weight_axis:
        what = "activations are quantized per tensor" if weight_axis is None else \
            f"weights are per output channel along axis {weight_axis}"
        raise UsageError(f"{name}: axis={attrs['axis']!r} is not supported ({what}); use axis=None"
                         + ("" if weight_axis is None else f" or {weight_axis}"))
    cfg = QuantizerConfig(format=fmt, per_channel=axis is not None, narrow_range=bool(attrs["narrow_range"]),
                          enabled=bool(attrs["enable"]))
    return cfg, axis is not None


def _owners(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, int | None, int | None]]:
    """quantizer name -> (owning module, the weight axis ModelOpt's configs name, the weight axis of the tensor)
    for weight quantizers of quantized layers, (module, None, None) for the others.

    The two differ for Hugging Face's Conv1D (GPT-2), whose weight is stored (in, out), and for ConvTranspose, whose
    weight is (in, out / groups, *kernel): ModelOpt's presets say ``axis: 0`` meaning per output channel (as for
    Linear and Conv), which is axis 1 of those tensors, the axis TensorRT takes a deconvolution's per-channel scales
    on. (ModelOpt itself applies axis 0 to a ConvTranspose weight literally, per input channel; here the presets
    run unchanged on UNets and decoders, per output channel.)"""
    out: dict[str, tuple[torch.nn.Module, int | None, int | None]] = {}
    for mname, m in model.named_modules():
        for cname, child in m.named_children():
            if isinstance(child, TensorQuantizer):
                if isinstance(m, _QuantMixin):
                    axis = m.weight_axis if child is m.weight_quantizer else None
                else:  # a custom module's (mtq.register): its weight quantizer's axis 0 is the tensor's axis 0
                    axis = 0 if cname.endswith("weight_quantizer") else None
                named = 0 if axis is not None and (type(m).__name__ == "QuantConv1D"
                                                   or isinstance(m, torch.nn.modules.conv._ConvTransposeNd)) else axis
                out[f"{mname}.{cname}" if mname else cname] = (m, named, axis)
    return out


def _current(q: TensorQuantizer, named_axis: int | None) -> dict[str, Any]:
    """A quantizer's settings as ModelOpt attributes."""
    bits = {"int8": 8, "fp8_e4m3": (4, 3)}[q.config.format]
    return {"enable": q.enabled, "num_bits": bits, "axis": None if q.axis is None else named_axis,
            "narrow_range": q.config.narrow_range, "calibrator": "histogram" if q.histogram else "max"}


def _apply(model: torch.nn.Module, quant_rules: list[Rule], fresh: bool) -> None:
    """Set each quantizer from ``quant_cfg``, starting from a fresh quantizer's attributes (``fresh``, what
    mtq.quantize does) or from its current ones (ModelOpt's set_quantizer_by_cfg: a quantizer no entry
    matches is left as it is)."""
    for name, (owner, named_axis, weight_axis) in _owners(model).items():
        q = getattr(owner, name.rsplit(".", 1)[-1])
        now = _current(q, named_axis)
        attrs = _resolve(name, owner, quant_rules, _FRESH if fresh else now)
        if not fresh and {k: v for k, v in attrs.items() if k != "enable"} == {k: v for k, v in now.items()
                                                                               if k != "enable"}:
            q.enabled = bool(attrs["enable"])  # only switched on or off: amax, statistics, dynamic kept
            continue
        cfg, per_channel = _quantizer_config(name, attrs, named_axis)
        _reconfigure(q, cfg, weight_axis if per_channel else None, attrs.get("calibrator") == "histogram")


def set_quantizer_by_cfg(model: torch.nn.Module, quant_cfg: list[Any] | Mapping[str, Any]) -> None:
    """ModelOpt's ``mtq.set_quantizer_by_cfg``: the entries of ``quant_cfg`` (the list form, or the old dict
    form with ``"default"`` first) in order on the quantizers each matches (fnmatch on the name, and
    ``parent_class`` on the owning layer); quantizers no entry matches keep their settings. A quantizer whose
    format or axis changes loses its amax and statistics (recalibrate: ``mtq.calibrate``); one only switched on
    or off keeps them. The whole config is checked before any quantizer changes.

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG,
        ...                  lambda m: m(torch.randn(8, 4)))
        >>> mtq.set_quantizer_by_cfg(m, [{"quantizer_name": "*input_quantizer", "enable": False}])
        >>> m[0].input_quantizer.enabled, m[0].weight_quantizer.amax.shape
        (False, torch.Size([4]))
    """
    quant_rules = _checked_rules(quant_cfg)
    _apply(model, quant_rules, fresh=False)


@contextlib.contextmanager
def set_quantizer_by_cfg_context(model: torch.nn.Module, quant_cfg: list[Any] | Mapping[str, Any]) -> Iterator[None]:
    """ModelOpt's ``mtq.set_quantizer_by_cfg_context``: :func:`set_quantizer_by_cfg` for the ``with`` block only;
    on exit every quantizer gets back its settings (format, axis, on/off, calibrator). An amax set inside the
    block is kept, as in ModelOpt; one a format or axis change inside cleared is put back.

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG,
        ...                  lambda m: m(torch.randn(8, 4)))
        >>> with mtq.set_quantizer_by_cfg_context(m, [{"quantizer_name": "*", "enable": False}]):
        ...     m[0].input_quantizer.enabled
        False
        >>> m[0].input_quantizer.enabled
        True
    """
    saved = [(q, q.config, q.axis, q.enabled, q.histogram, q.amax, q.calibrator) for _, q in api.quantizers(model)]
    set_quantizer_by_cfg(model, quant_cfg)  # checked whole before any quantizer changes
    try:
        yield
    finally:
        for q, config, axis, enabled, histogram, amax, calibrator in saved:
            changed = q.config.replace(enabled=True) != config.replace(enabled=True) or q.axis != axis
            q.config, q.axis, q.enabled, q.histogram = config, axis, enabled, histogram
            if changed or q.amax is None:
                q.amax, q.calibrator = amax, calibrator


def _checked_rules(quant_cfg: Any) -> list[Rule]:
    """The rules of ``quant_cfg``, every entry's attributes checked (axis is checked per quantizer when applied:
    whether it fits depends on the layer)."""
    quant_rules = rules(quant_cfg)
    for rule in quant_rules:
        if rule.cfg is not None:
            _quantizer_config(rule.label, {**_FRESH, **_check_entry(rule.label, rule.cfg), "axis": None},
                              weight_axis=None)
    return quant_rules


def set_quantizer_attribute(model: torch.nn.Module, wildcard_or_filter_func: str | Callable[[str], bool],
                            attribute: Mapping[str, Any], parent_class: type | None = None) -> None:
    """ModelOpt's ``mtq.set_quantizer_attribute``: the attributes in ``attribute`` (``enable``, ``num_bits``,
    ``axis``, ``narrow_range``) on the quantizers whose names match (fnmatch pattern, or a function of the
    name), only those owned by a ``parent_class`` instance if given; other attributes are kept.

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG,
        ...                  lambda m: m(torch.randn(8, 4)))
        >>> mtq.set_quantizer_attribute(m, lambda name: name.endswith("weight_quantizer"), {"enable": False})
        >>> m[0].weight_quantizer.enabled, m[0].input_quantizer.enabled
        (False, True)
    """
    if isinstance(attribute, (list, tuple)):
        raise UsageError("a list of attributes (ModelOpt's SequentialQuantizer, used for W4A8) is not supported; "
                         "give one dict of attributes")
    _check_entry(str(wildcard_or_filter_func), attribute)
    match = wildcard_or_filter_func if callable(wildcard_or_filter_func) else (
        lambda n: fnmatch.fnmatch(n, wildcard_or_filter_func))  # type: ignore[arg-type]
    for name, (owner, named_axis, weight_axis) in _owners(model).items():
        if not match(name) or (parent_class is not None and not isinstance(owner, parent_class)):
            continue
        q = getattr(owner, name.rsplit(".", 1)[-1])
        now = _current(q, named_axis)
        attrs = {**now, **attribute}
        if {k: v for k, v in attrs.items() if k != "enable"} == {k: v for k, v in now.items() if k != "enable"}:
            q.enabled = bool(attrs["enable"])
            continue
        cfg, per_channel = _quantizer_config(name, attrs, named_axis)
        _reconfigure(q, cfg, weight_axis if per_channel else None, attrs.get("calibrator") == "histogram")


def set_from_attribute_config(q: TensorQuantizer, attribute_cfg: Mapping[str, Any]) -> None:
    """ModelOpt's ``TensorQuantizer.set_from_attribute_config``: the attributes given (a dict, or a
    ``QuantizerAttributeConfig``, which gives all of them) set on the quantizer ``q``, the others kept. ``axis`` is
    the axis of the tensor ``q`` quantizes (0: per row of a Linear weight), as ModelOpt applies it. A change of
    format or axis leaves ``q`` uncalibrated; switching ``enable`` alone keeps its amax.

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> q = mtq.nn.TensorQuantizer()
        >>> set_from_attribute_config(q, {"num_bits": (4, 3), "axis": 0})
        >>> q.num_bits, q.axis, q.config.per_channel
        ((4, 3), 0, True)
    """
    where = f"{q.name or 'TensorQuantizer'}.set_from_attribute_config"
    if not isinstance(attribute_cfg, Mapping):
        raise UsageError(f"{where}({attribute_cfg!r}): expected a dict of quantizer attributes or a "
                         "QuantizerAttributeConfig, e.g. {'num_bits': 8, 'axis': None}")
    now = _current(q, None if q.axis is None else int(q.axis))
    attrs = {**now, **_check_entry(where, attribute_cfg, where=where)}
    axis = attrs["axis"]
    axis = axis[0] if isinstance(axis, (tuple, list)) and len(axis) == 1 else axis
    if axis is not None and not isinstance(axis, int):
        raise UsageError(f"{where}: axis={attrs['axis']!r} is not supported; use None (per tensor) or one axis (0)")
    if {k: v for k, v in attrs.items() if k != "enable"} == {k: v for k, v in now.items() if k != "enable"}:
        q.enabled = bool(attrs["enable"])
        return
    cfg, per_channel = _quantizer_config(where, {**attrs, "axis": axis}, axis)
    _reconfigure(q, cfg, axis if per_channel else None, attrs.get("calibrator") == "histogram")


def _reconfigure(q: TensorQuantizer, cfg: QuantizerConfig, axis: int | None, histogram: bool = False) -> None:
    q.hist_max_bins = MODELOPT_MAX_BINS_FACTOR * q.num_bins  # ModelOpt's histogram bins never coarsen
    if histogram != q.histogram:  # a new kind of statistics: the old ones (and the amax from them) go
        q.histogram, q.amax, q.calibrator = histogram, None, None
    if cfg.replace(enabled=True) == q.config.replace(enabled=True) and axis == q.axis:
        q.enabled = cfg.enabled  # only switched on or off: keep amax and statistics
        q.config = cfg
        return
    q.config, q.axis, q.enabled = cfg, axis, cfg.enabled
    q.histogram = histogram and axis is None
    q.amax = None
    q.calibrator = None


def register(original_cls: type[torch.nn.Module], quantized_cls: type[torch.nn.Module]) -> None:
    """ModelOpt's ``mtq.register``: from now on ``mtq.quantize`` turns every module of exactly ``original_cls``
    into a ``quantized_cls``, sharing its parameters, and calls its ``_setup()``, which creates the quantizers
    its forward calls (``self.input_quantizer = TensorQuantizer()``, ``self.weight_quantizer = ...``). The config's
    patterns then set them (``*weight_quantizer`` ``axis: 0`` is per slice of the weight's axis 0) and they are
    calibrated on the forward loop's data, weights included. The registry (``mtq.nn.QuantModuleRegistry``) is
    process-wide and filled only by these calls; :func:`unregister` undoes one.

    Example:
        >>> import torch, torch.nn.functional as F, overdrive.quant.modelopt as mtq
        >>> class QuantLayerNorm(torch.nn.LayerNorm):
        ...     def _setup(self):
        ...         self.input_quantizer = mtq.nn.TensorQuantizer()
        ...         self.weight_quantizer = mtq.nn.TensorQuantizer()
        ...     def forward(self, x):
        ...         w = self.weight_quantizer(self.weight)
        ...         return F.layer_norm(self.input_quantizer(x), self.normalized_shape, w, self.bias, self.eps)
        >>> mtq.register(original_cls=torch.nn.LayerNorm, quantized_cls=QuantLayerNorm)
        >>> try:
        ...     m = mtq.quantize(torch.nn.Sequential(torch.nn.LayerNorm(8)), mtq.INT8_DEFAULT_CFG,
        ...                      lambda m: m(torch.randn(4, 8)))
        ... finally:
        ...     mtq.unregister(torch.nn.LayerNorm)
        >>> type(m[0]).__name__, m[0].weight_quantizer.amax.shape, m[0].input_quantizer.is_calibrated
        ('QuantLayerNorm', torch.Size([8]), True)
    """
    from overdrive.quant.modelopt.nn import QuantModuleRegistry

    QuantModuleRegistry.register({original_cls: original_cls.__name__})(quantized_cls)


def unregister(original_cls: type[torch.nn.Module]) -> None:
    """ModelOpt's ``mtq.unregister``: ``original_cls`` is no longer quantized by a registered class (modules
    quantized before keep theirs).

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> class QuantReLU(torch.nn.ReLU):
        ...     def _setup(self): self.input_quantizer = mtq.nn.TensorQuantizer()
        >>> mtq.register(original_cls=torch.nn.ReLU, quantized_cls=QuantReLU); mtq.unregister(torch.nn.ReLU)
        >>> torch.nn.ReLU in mtq.nn.QuantModuleRegistry
        False
    """
    from overdrive.quant.modelopt.nn import QuantModuleRegistry

    QuantModuleRegistry.unregister(original_cls)


def _insert_quantizers(model: torch.nn.Module, config: QuantConfig) -> torch.nn.Module:
    """quant.quantize's layer swap (no calibration), then every module whose type is in
    ``mtq.nn.QuantModuleRegistry`` replaced by its registered quantized class, and the layers ModelOpt quantizes
    beyond quant.quantize's (pools' inputs, ConvTranspose1d / 3d: ``mtq.nn.convert_builtin``); quantizers get
    their names.
    A registered type that quant.quantize swaps itself (``nn.Linear``) is left to the registered class."""
    from overdrive.quant.modelopt.nn import QuantModuleRegistry, convert_builtin

    def convert(m: torch.nn.Module) -> torch.nn.Module:
        return QuantModuleRegistry.convert(m) if type(m) in QuantModuleRegistry else (convert_builtin(m) or m)

    overridden = {c.__name__ for c in QuantModuleRegistry}
    if overridden & set(config.layer_types):
        config = config.replace(layer_types=tuple(t for t in config.layer_types if t not in overridden))
    model = api.quantize(model, config, forward_loop=None)
    meta = model._overdrive_quant
    root = convert(model)
    if root is not model:
        model, model._overdrive_quant = root, meta
        meta["skipped"].pop("<root>", None)
    done: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}  # id(original) -> (original kept alive, new)

    def convert_below(parent: torch.nn.Module, prefix: str) -> None:
        for cname, child in list(parent._modules.items()):  # _modules: a shared module under every name
            if child is None:
                continue
            if id(child) in done:
                setattr(parent, cname, done[id(child)][1])
                continue
            new = convert(child)
            done[id(child)] = (child, new)
            if new is not child:
                setattr(parent, cname, new)
                meta["skipped"].pop(prefix + cname, None)
            convert_below(new, f"{prefix}{cname}.")

    convert_below(model, "")
    api._keep_layers_called(model)  # for quantized layers the registered classes placed in encoder layers too
    for name, q in api.quantizers(model):
        q.name = q.name or name
    return model
