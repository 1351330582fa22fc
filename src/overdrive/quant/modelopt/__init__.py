"""ModelOpt's ``modelopt.torch.quantization`` names over overdrive.quant, so a ModelOpt script runs with one line
changed: ``import modelopt.torch.quantization as mtq`` -> ``import overdrive.quant.modelopt as mtq`` (and
``import modelopt.torch.opt as mto`` -> ``import overdrive.quant.modelopt.opt as mto``).

A config's ``quant_cfg`` is taken in both of ModelOpt's forms (:mod:`overdrive.quant.modelopt.quant_cfg`): the
current ordered list of entries (``quantizer_name`` fnmatch pattern on quantizer names such as
``"*weight_quantizer"``, optional ``parent_class`` such as ``"nn.Linear"``, ``cfg`` of attributes, ``enable``;
later entries override earlier ones; a ``cfg`` entry replaces the attributes, an ``enable``-only entry just
switches quantizers on or off), and the older dict of patterns (``"default"`` first, then each key in order).
Attributes: ``num_bits`` 8 or (4, 3) / ``"e4m3"``, ``axis``, ``narrow_range``. ``algorithm`` ``"max"``
calibrates with max; None leaves activations uncalibrated. The presets' ``quant_cfg`` is a list that also takes
the old dict-style edits, so scripts of either generation run on a ``copy.deepcopy`` of one.

Example:
    >>> import copy, torch
    >>> import overdrive.quant.modelopt as mtq
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    >>> cfg["quant_cfg"].append({"quantizer_name": "2*", "enable": False})  # keep the last layer in float
    >>> model = mtq.quantize(model, cfg, forward_loop=lambda m: m(torch.randn(32, 8)))
    >>> model[0].input_quantizer.is_calibrated, model[2].weight_quantizer.enabled
    (True, False)
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant import api
from overdrive.quant.calibrators import MODELOPT_MAX_BINS_FACTOR
from overdrive.quant.config import QuantConfig, QuantizerConfig
from overdrive.quant.modules import _QuantMixin
from overdrive.quant.quantizer import TensorQuantizer

ForwardLoop = Callable[[torch.nn.Module], Any]


from overdrive.quant.modelopt.config import (_MISSING_FUNCTIONS, _MISSING_PRESETS, FP8_DEFAULT_CFG, INT8_DEFAULT_CFG,
                                             INT8_SMOOTHQUANT_CFG, INT8_WEIGHT_ONLY_CFG, MissingPresetError,
                                             QuantizerAttributeConfig)
from overdrive.quant.modelopt.quant_cfg import (QuantCfgList, Rule, find_quant_cfg_entry_by_path,
                                                normalize_quant_cfg_list, rules)


def __getattr__(name: str) -> Any:
    if name in _MISSING_PRESETS:
        raise MissingPresetError(f"mtq.{name} is not available in overdrive.quant.modelopt: {_MISSING_PRESETS[name]}")
    if name in _MISSING_FUNCTIONS:
        raise MissingPresetError(f"mtq.{name} is not available in overdrive.quant.modelopt: {_MISSING_FUNCTIONS[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_NOT_IMPLEMENTED = {
    "awq": "AWQ is not implemented in overdrive.quant; for 4-bit weights use quant.weight_only(model, bits=4, "
           "group_size=128) (round-to-nearest, per-group scales)",
}
_ATTRS = ("enable", "num_bits", "axis", "narrow_range", "unsigned", "fake_quant", "trt_high_precision_dtype",
          "calibrator")
# ModelOpt attributes accepted at their default value only (what a config that spells out every default has)
_DEFAULT_ONLY = {"type": "static", "bias": None, "learn_amax": False, "rotate": False, "pass_through_bwd": True,
                 "use_constant_amax": False, "backend": None, "backend_extra_args": None}


# ModelOpt's SmoothQuantCalibConfig default (and its smoothquant(model, forward_loop, alpha=1.0)): "smoothquant" with
# no alpha moves all of each input channel's range into the weight (x / max|x_j|). quant.INT8_SMOOTHQUANT keeps the
# paper's 0.5; a ported script gets ModelOpt's numerics.
_SMOOTHQUANT_ALPHA = 1.0


def _smoothquant_alpha(algorithm: Any) -> float | None:
    """SmoothQuant's alpha when ``algorithm`` asks for it ("smoothquant", or a dict with "alpha"), else None."""
    from overdrive.quant.config import check_alpha

    if algorithm == "smoothquant":
        return _SMOOTHQUANT_ALPHA
    if isinstance(algorithm, Mapping) and algorithm.get("method") == "smoothquant":
        bad = [k for k in algorithm if k not in ("method", "alpha")]
        if bad:
            raise UsageError(f"smoothquant settings {bad} are not supported; it takes 'alpha' (default "
                             f"{_SMOOTHQUANT_ALPHA}, as ModelOpt)")
        alpha = algorithm.get("alpha")
        return _SMOOTHQUANT_ALPHA if alpha is None else check_alpha(alpha)
    return None


def _method(algorithm: Any) -> str | None:
    """ModelOpt's ``algorithm`` as an overdrive calibration method (None: do not calibrate activations)."""
    if _smoothquant_alpha(algorithm) is not None:
        return "max"  # SmoothQuant's factors first, then max calibration, as in ModelOpt
    if isinstance(algorithm, Mapping):
        algorithm = algorithm.get("method")
    if algorithm is None or algorithm == "max":
        return algorithm
    if isinstance(algorithm, str):
        key = "awq" if algorithm.startswith("awq") else algorithm
        if key in _NOT_IMPLEMENTED:
            raise UsageError(f"algorithm {algorithm!r} is not supported: {_NOT_IMPLEMENTED[key]}")
    raise UsageError(f"algorithm {algorithm!r} is not supported; use 'max' (or None to skip calibration); for "
                     "entropy / mse / percentile give the input quantizers 'calibrator': 'histogram' in quant_cfg, "
                     "then mtq.model_calib.finish_stats_collection(model, method='entropy') (ModelOpt's route), or "
                     "quant.calibrate(model, forward_loop, method='entropy')")


def _check_entry(pattern: str, attrs: Any) -> dict[str, Any]:
    """The supported attributes of one entry (num_bits as 8 or (4, 3)); a UsageError names any other."""
    if not isinstance(attrs, Mapping):
        raise UsageError(f"quant_cfg[{pattern!r}] = {attrs!r} must be a dict of quantizer attributes, e.g. "
                         '{"num_bits": 8, "axis": None} or {"enable": False}')
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


def quantize(model: torch.nn.Module, config: Mapping[str, Any], forward_loop: ForwardLoop | None = None) -> torch.nn.Module:
    """ModelOpt's ``mtq.quantize(model, config, forward_loop)``: quant.quantize's layer swap, then each quantizer
    set from ``config["quant_cfg"]`` (the list of entries or the old dict, see the module doc; checked whole
    before the model is touched), weights max-calibrated and ``forward_loop(model)`` run once for the
    activations (``config["algorithm"]`` ``"max"``). Residual adds and attention matmuls get no quantizers
    (ModelOpt puts none there). Returns the model.
    """
    if isinstance(config, QuantConfig):
        return api.quantize(model, config, forward_loop)
    if not isinstance(config, Mapping) or "quant_cfg" not in config:
        raise UsageError(f"config must be a ModelOpt dict with 'quant_cfg' (e.g. mtq.INT8_DEFAULT_CFG), or a "
                         f"quant.QuantConfig; got {type(config).__name__}")
    bad = [k for k in config if k not in ("quant_cfg", "algorithm")]
    if bad:
        raise UsageError(f"config keys {bad} are not supported; a ModelOpt config has 'quant_cfg' and 'algorithm'")
    method = _method(config.get("algorithm", "max"))
    forward_loop = _takes_model(forward_loop)
    quant_rules = _checked_rules(config["quant_cfg"])  # refuse bad entries before the model is touched
    alpha = _smoothquant_alpha(config.get("algorithm", "max"))
    model = _insert_quantizers(model, QuantConfig(residual_add=False, smoothquant=alpha))
    _apply(model, quant_rules, fresh=True)
    if alpha is not None and forward_loop is not None:
        from overdrive.quant.smoothquant import smooth

        model._overdrive_quant["smoothed"] = smooth(model, forward_loop, alpha)
    api._calibrate_weights(model)
    if forward_loop is not None and method is not None and any(q.enabled for q in api._activation_quantizers(model)):
        api.calibrate(model, forward_loop, method=method)
    return model


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
    for name, q in api.quantizers(model):
        q.name = q.name or name
    return model


def _takes_model(forward_loop: ForwardLoop | None) -> ForwardLoop | None:
    """ModelOpt's older ``forward_loop()`` without arguments (still accepted there, with a warning) as one
    taking the model."""
    if forward_loop is None:
        return None
    try:
        params = inspect.signature(forward_loop).parameters.values()
    except (TypeError, ValueError):
        return forward_loop
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) or len(params) > 0:
        return forward_loop
    warnings.warn("forward_loop should take the model as its argument (def forward_loop(model): ...); one with no "
                  "arguments is run as it is", DeprecationWarning, stacklevel=3)
    return lambda model: forward_loop()  # type: ignore[call-arg]


def calibrate(model: torch.nn.Module, algorithm: Any = "max", forward_loop: ForwardLoop | None = None) -> torch.nn.Module:
    """ModelOpt's ``mtq.calibrate``: weights without amax get max |w| (after a format or axis change), then the
    enabled activation quantizers are recalibrated with ``forward_loop``; ``algorithm`` None calibrates nothing.

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG)
        >>> m = mtq.calibrate(m, "max", forward_loop=lambda m: m(torch.ones(2, 4)))
        >>> float(m[0].input_quantizer.amax)
        1.0
    """
    method = _method(algorithm)
    forward_loop = _takes_model(forward_loop)
    if method is None:
        return model
    api._calibrate_weights(model, missing_only=True)
    if forward_loop is not None and any(q.enabled for q in api._activation_quantizers(model)):
        api.calibrate(model, forward_loop, method=method)
    return model


def postprocess_amax(model: torch.nn.Module, key: str, post_process_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """ModelOpt's ``mtq.postprocess_amax``: ``amax = post_process_fn(amax)`` for every calibrated quantizer whose
    name matches the fnmatch pattern ``key``; returns the model. A result in ModelOpt's keep-dims shape
    ((C, 1) per channel) is taken as (C,).

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG,
        ...                  lambda m: m(torch.full((2, 4), 1e-4)))
        >>> m = mtq.postprocess_amax(m, "*input_quantizer", lambda amax: torch.clamp(amax, min=0.01))
        >>> round(float(m[0].input_quantizer.amax), 6)
        0.01
    """
    if not isinstance(key, str):
        raise UsageError(f"key must be an fnmatch pattern on quantizer names, e.g. '*input_quantizer'; got {key!r}")
    for name, q in api.quantizers(model):
        if q.amax is not None and fnmatch.fnmatch(name, key):
            amax = post_process_fn(q.amax)
            if not isinstance(amax, torch.Tensor):
                raise UsageError(f"post_process_fn must return a tensor (amax of {name}); got {type(amax).__name__}")
            q.amax = amax.detach().float().to(q.amax.device)
    return model


@torch.no_grad()
def fold_weight(model: torch.nn.Module) -> None:
    """ModelOpt's ``mtq.fold_weight``: write each quantized layer's fake-quantized weight into the weight
    (SmoothQuant's factor included) and turn its weight quantizer off, so evaluation skips re-quantizing the
    weights; the outputs stay the same. Input quantizers are untouched.

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG,
        ...                  lambda m: m(torch.randn(8, 4)))
        >>> x = torch.randn(2, 4); before = m(x); mtq.fold_weight(m)
        >>> bool(torch.equal(before, m(x))), m[0].weight_quantizer.enabled
        (True, False)
    """
    # A weight two modules share (a tied embedding and LM head, a shared projection): folding it into one layer's
    # quantized form changed the other's weight too (and a second quantized user quantized it again). Those stay
    # quantized on the fly.
    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, param in m.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{mname}.{pname}" if mname else pname)
    shared: list[str] = []
    for mname, m in model.named_modules():
        if not isinstance(m, _QuantMixin):
            continue
        q = m.weight_quantizer
        if q.enabled and q.quant_enabled and not q.calibrating and q.is_calibrated:
            if len(set(owners.get(id(m.weight), []))) > 1:
                shared.append(mname)
                continue
            m.weight.copy_(q(m.weight).to(m.weight.dtype))
            q.pre_quant_scale = None  # already in the folded weight
            q.enabled = False
    if shared:
        warnings.warn(f"mtq.fold_weight: {len(shared)} layer(s) share their weight with another module ("
                      f"{', '.join(shared[:5])}{', ...' if len(shared) > 5 else ''}); their weights were not folded (the "
                      "other module would have changed too) and stay quantized on the fly", RuntimeWarning, stacklevel=2)


def _select(model: torch.nn.Module, wildcard_or_filter: str | Callable[[str], bool]) -> list[TensorQuantizer]:
    if not (isinstance(wildcard_or_filter, str) or callable(wildcard_or_filter)):
        raise UsageError(f"wildcard_or_filter={wildcard_or_filter!r} must be one fnmatch pattern string (e.g. "
                         "'*lm_head*') or a function of the quantizer's name; call once per pattern")
    match = wildcard_or_filter if callable(wildcard_or_filter) else (
        lambda n: fnmatch.fnmatch(n, wildcard_or_filter))  # type: ignore[arg-type]
    return [q for n, q in api.quantizers(model) if match(n)]


def disable_quantizer(model: torch.nn.Module, wildcard_or_filter: str | Callable[[str], bool]) -> None:
    """Turn off the quantizers whose names match (fnmatch pattern, or a function of the name)."""
    for q in _select(model, wildcard_or_filter):
        q.enabled = False


def enable_quantizer(model: torch.nn.Module, wildcard_or_filter: str | Callable[[str], bool]) -> None:
    """Turn on the quantizers whose names match (fnmatch pattern, or a function of the name)."""
    for q in _select(model, wildcard_or_filter):
        q.enabled = True


def print_quant_summary(model: torch.nn.Module) -> None:
    """One line per quantizer (name, format, axis, amax), then the count, as ModelOpt prints it; the table with
    skipped layers and why is quant.print_summary(model)."""
    qs = list(api.quantizers(model))
    width = max((len(n) for n, _ in qs), default=0)
    for name, q in qs:
        print(f"{name:<{width}}  TensorQuantizer({q.extra_repr()})")
    print(f"{len(qs)} TensorQuantizers found in model")


__all__ = ["INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT8_WEIGHT_ONLY_CFG", "QuantCfgList",
           "QuantizerAttributeConfig", "QuantModuleRegistry", "TensorQuantizer",
           "normalize_quant_cfg_list", "find_quant_cfg_entry_by_path", "quantize", "calibrate",
           "register", "unregister",
           "set_quantizer_by_cfg", "set_quantizer_by_cfg_context", "set_quantizer_attribute", "postprocess_amax", "fold_weight", "disable_quantizer",
           "enable_quantizer", "print_quant_summary", "nn"]

from overdrive.quant.modelopt import nn  # noqa: E402  (mtq.nn.TensorQuantizer; imported last: it needs nothing above)
from overdrive.quant.modelopt import model_calib  # noqa: E402, F401  (mtq.model_calib.finish_stats_collection)
from overdrive.quant.modelopt import utils  # noqa: E402  (mtq.utils.is_quantized, as ModelOpt's package has it)
from overdrive.quant.modelopt.nn import QuantModuleRegistry  # noqa: E402  (mtq.QuantModuleRegistry, as ModelOpt)
