"""ModelOpt's ``modelopt.torch.quantization`` names over overdrive.quant, so a ModelOpt script runs with one line
changed: ``import modelopt.torch.quantization as mtq`` -> ``import overdrive.quant.modelopt as mtq`` (and
``import modelopt.torch.opt as mto`` -> ``import overdrive.quant.modelopt.opt as mto``).

ModelOpt's dict configs are translated quantizer by quantizer onto :func:`overdrive.quant.quantize`'s modules:
``quant_cfg`` maps fnmatch patterns on quantizer names (``"*weight_quantizer"``, ``"*lm_head*"``) to attributes
(``num_bits`` 8 or (4, 3), ``axis``, ``enable``, ``narrow_range``); ``"default"`` applies first, then every
other entry in order, each one updating what it names (an entry without ``enable`` turns the quantizer on, as
in ModelOpt). ``algorithm`` ``"max"`` calibrates with max; None leaves activations uncalibrated.

Example:
    >>> import copy, torch
    >>> import overdrive.quant.modelopt as mtq
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    >>> cfg["quant_cfg"]["2*"] = {"enable": False}     # keep the last layer in float
    >>> model = mtq.quantize(model, cfg, forward_loop=lambda m: m(torch.randn(32, 8)))
    >>> model[0].input_quantizer.is_calibrated, model[2].weight_quantizer.enabled
    (True, False)
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant import api
from overdrive.quant.config import QuantConfig, QuantizerConfig
from overdrive.quant.modules import _QuantMixin
from overdrive.quant.quantizer import TensorQuantizer

ForwardLoop = Callable[[nn.Module], Any]


class _ReadOnlyDict(dict):
    """A preset dict that refuses edits, so one script cannot change the preset for every later user in the
    process; ``copy.deepcopy`` (what ModelOpt's docs do before editing) gives plain, editable dicts."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError("mtq's preset configs are read-only; edit a copy: cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG); "
                         'cfg["quant_cfg"]["*lm_head*"] = {"enable": False}')

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


def _read_only(d: Any) -> Any:
    return _ReadOnlyDict({k: _read_only(v) for k, v in d.items()}) if isinstance(d, dict) else d


# ModelOpt's list of layers its presets keep in float (routers, output heads, norms)
_DEFAULT_DISABLED = {
    "nn.BatchNorm1d": {"*": {"enable": False}},
    "nn.BatchNorm2d": {"*": {"enable": False}},
    "nn.BatchNorm3d": {"*": {"enable": False}},
    "nn.LeakyReLU": {"*": {"enable": False}},
    "*lm_head*": {"enable": False},
    "*proj_out.*": {"enable": False},
    "*block_sparse_moe.gate*": {"enable": False},
    "*router*": {"enable": False},
    "*mlp.gate.*": {"enable": False},
    "*mlp.shared_expert_gate.*": {"enable": False},
    "*output_layer*": {"enable": False},
    "output.*": {"enable": False},
    "default": {"enable": False},
}

INT8_DEFAULT_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8, "axis": None},
                  **_DEFAULT_DISABLED},
    "algorithm": "max",
})
"""int8 per-channel weights, per-tensor activations, max calibration (quant.INT8_DEFAULT's numerics)."""

FP8_DEFAULT_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3), "axis": None},
                  "*input_quantizer": {"num_bits": (4, 3), "axis": None}, **_DEFAULT_DISABLED},
    "algorithm": "max",
})
"""fp8 e4m3 per-tensor weights and activations (as ModelOpt; quant.FP8_DEFAULT has per-channel weights)."""

INT8_SMOOTHQUANT_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8, "axis": None},
                  **_DEFAULT_DISABLED},
    "algorithm": "smoothquant",
})
"""SmoothQuant (alpha 0.5; ``{"method": "smoothquant", "alpha": a}`` sets it) then max calibration: int8 per-channel
weights, per-tensor activations (quant.INT8_SMOOTHQUANT's numerics with [-128, 127] weights)."""

INT8_WEIGHT_ONLY_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"enable": False},
                  **_DEFAULT_DISABLED},
    "algorithm": "max",
})
"""int8 per-channel weights, activations left in float (ModelOpt's weight-only int8)."""

# ModelOpt presets this port does not provide, and what to use instead: ``mtq.INT4_AWQ_CFG`` raises this (an
# AttributeError that says so) instead of a bare "module has no attribute"
_WEIGHT_4BIT = ("overdrive.quant has no 4-bit fake quantization for mtq.quantize; for 4-bit weights use "
                "quant.weight_only(model, bits=4, group_size=128) (round-to-nearest per-group scales, no AWQ search)")
_MISSING_PRESETS = {
    **{n: _WEIGHT_4BIT for n in ("INT4_AWQ_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A8_AWQ_BETA_CFG")},
    **{n: "NVFP4 / MX formats need Blackwell-class kernels and block scales, which overdrive.quant does not have; "
          "use mtq.FP8_DEFAULT_CFG (Hopper fp8) or mtq.INT8_DEFAULT_CFG"
       for n in ("NVFP4_DEFAULT_CFG", "NVFP4_AWQ_LITE_CFG", "NVFP4_AWQ_CLIP_CFG", "NVFP4_AWQ_FULL_CFG",
                 "NVFP4_MLP_ONLY_CFG", "NVFP4_MLP_WEIGHT_ONLY_CFG", "W4A8_NVFP4_FP8_CFG", "MXFP8_DEFAULT_CFG",
                 "MXFP6_DEFAULT_CFG", "MXFP4_DEFAULT_CFG", "MXINT8_DEFAULT_CFG", "W4A8_MXFP4_FP8_CFG")},
    **{n: "KV-cache quantization is not in overdrive.quant; quantize the GEMMs with mtq.FP8_DEFAULT_CFG and keep the "
          "KV cache in the model's dtype" for n in ("FP8_KV_CFG", "FP8_AFFINE_KV_CFG", "NVFP4_KV_CFG",
                                                    "NVFP4_AFFINE_KV_CFG", "NVFP4_KV_ROTATE_CFG")},
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": "per-token fp8 activation scales are not in this port; use mtq.FP8_DEFAULT_CFG "
                                     "(per-tensor) or quant.dynamic_int8(model) for per-token int8",
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": "block-wise fp8 weights are not in this port; use mtq.FP8_DEFAULT_CFG",
}


class MissingPresetError(UsageError, AttributeError):
    """A ModelOpt preset name this port does not provide: says what to use instead (an AttributeError too, so
    ``hasattr(mtq, name)`` is False and ``getattr(mtq, name, default)`` works).

    Example:
        >>> import overdrive.quant.modelopt as mtq
        >>> hasattr(mtq, "NVFP4_DEFAULT_CFG"), hasattr(mtq, "INT8_DEFAULT_CFG")
        (False, True)
    """


def __getattr__(name: str) -> Any:
    if name in _MISSING_PRESETS:
        raise MissingPresetError(f"mtq.{name} is not available in overdrive.quant.modelopt: {_MISSING_PRESETS[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_NOT_IMPLEMENTED = {
    "awq": "AWQ is not implemented in overdrive.quant; for 4-bit weights use quant.weight_only(model, bits=4, "
           "group_size=128) (round-to-nearest, per-group scales)",
}
_ATTRS = ("enable", "num_bits", "axis", "narrow_range", "unsigned", "fake_quant", "trt_high_precision_dtype",
          "calibrator")


def _smoothquant_alpha(algorithm: Any) -> float | None:
    """SmoothQuant's alpha when ``algorithm`` asks for it ("smoothquant", or a dict with "alpha"), else None."""
    from overdrive.quant.config import check_alpha

    if algorithm == "smoothquant":
        return 0.5
    if isinstance(algorithm, Mapping) and algorithm.get("method") == "smoothquant":
        bad = [k for k in algorithm if k not in ("method", "alpha")]
        if bad:
            raise UsageError(f"smoothquant settings {bad} are not supported; it takes 'alpha' (default 0.5)")
        return check_alpha(algorithm.get("alpha", 0.5))
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
    raise UsageError(f"algorithm {algorithm!r} is not supported; use 'max' (or None to skip calibration); other "
                     "calibrators: quant.calibrate(model, forward_loop, method='percentile'|'entropy'|'mse')")


def _check_entry(pattern: str, attrs: Any) -> dict[str, Any]:
    if not isinstance(attrs, Mapping):
        raise UsageError(f"quant_cfg[{pattern!r}] = {attrs!r} must be a dict of quantizer attributes, e.g. "
                         '{"num_bits": 8, "axis": None} or {"enable": False}')
    bad = [k for k in attrs if k not in _ATTRS]
    if "block_sizes" in bad:
        raise UsageError(f"quant_cfg[{pattern!r}] has block_sizes (block-wise / int4 quantization), which "
                         "overdrive.quant does not fake-quantize; for grouped 4- or 8-bit weights use "
                         "quant.weight_only(model, bits=4, group_size=128)")
    if bad:
        raise UsageError(f"quant_cfg[{pattern!r}] has unsupported attribute(s) {bad}; supported: {list(_ATTRS)}")
    return dict(attrs)


def _resolve(name: str, owner: nn.Module, quant_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes ModelOpt would give the quantizer ``name`` (owned by ``owner``): defaults, then
    ``default``, then every matching entry in order."""
    attrs: dict[str, Any] = {"enable": True, "num_bits": 8, "axis": None, "narrow_range": False}
    entries = ([("*", quant_cfg["default"], name)] if "default" in quant_cfg else [])
    local = name.rsplit(".", 1)[-1]
    for pattern, value in quant_cfg.items():
        if pattern == "default":
            continue
        if pattern.startswith("nn.") and isinstance(value, Mapping) and all(isinstance(v, Mapping) for v in value.values()):
            # {"nn.BatchNorm2d": {"*": {...}}}: by layer class, the inner pattern on the quantizer's own name
            if type(owner).__name__ == pattern[3:] or any(b.__name__ == pattern[3:] for b in type(owner).__mro__
                                                          if b.__module__.startswith("torch.nn")):
                entries += [(p, v, local) for p, v in value.items()]
            continue
        entries.append((pattern, value, name))
    for pattern, value, target in entries:
        if fnmatch.fnmatch(target, pattern):
            entry = _check_entry(pattern, value)
            if "enable" not in entry:  # ModelOpt: an entry of attributes turns the quantizer on
                entry["enable"] = True
            attrs.update(entry)
    return attrs


def _quantizer_config(name: str, attrs: dict[str, Any], weight_axis: int | None) -> tuple[QuantizerConfig, bool]:
    """(QuantizerConfig, per_channel) for ModelOpt attributes; ``weight_axis`` None for activation quantizers."""
    bits = attrs["num_bits"]
    bits = tuple(bits) if isinstance(bits, list) else bits
    fmt = {8: "int8", (4, 3): "fp8_e4m3"}.get(bits)  # type: ignore[call-overload]
    if fmt is None:
        raise UsageError(f"{name}: num_bits={bits!r} is not supported; use 8 (int8) or (4, 3) (fp8 e4m3); for 4-bit "
                         "weights use quant.weight_only(model, bits=4)")
    if attrs.get("unsigned"):
        raise UsageError(f"{name}: unsigned=True is not supported; overdrive.quant quantizes symmetrically (zero point 0)")
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


def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, int | None, int | None]]:
    """quantizer name -> (owning module, the weight axis ModelOpt's configs name, the weight axis of the tensor)
    for weight quantizers of quantized layers, (module, None, None) for the others.

    The two differ for Hugging Face's Conv1D (GPT-2), whose weight is stored (in, out): ModelOpt's configs say
    ``axis: 0`` meaning per output channel, which is axis 1 of that tensor."""
    out: dict[str, tuple[nn.Module, int | None, int | None]] = {}
    for mname, m in model.named_modules():
        for cname, child in m.named_children():
            if isinstance(child, TensorQuantizer):
                axis = m.weight_axis if isinstance(m, _QuantMixin) and child is m.weight_quantizer else None
                named = 0 if axis is not None and type(m).__name__ == "QuantConv1D" else axis
                out[f"{mname}.{cname}" if mname else cname] = (m, named, axis)
    return out


def set_quantizer_by_cfg(model: nn.Module, quant_cfg: Mapping[str, Any]) -> None:
    """Give every quantizer of ``model`` the attributes ``quant_cfg`` assigns it (ModelOpt's function of that
    name). A quantizer whose attributes change loses its amax and statistics (recalibrate)."""
    for name, (owner, named_axis, weight_axis) in _owners(model).items():
        q = getattr(owner, name.rsplit(".", 1)[-1])
        cfg, per_channel = _quantizer_config(name, _resolve(name, owner, quant_cfg), named_axis)
        _reconfigure(q, cfg, weight_axis if per_channel else None)


def _reconfigure(q: TensorQuantizer, cfg: QuantizerConfig, axis: int | None) -> None:
    if cfg.replace(enabled=True) == q.config.replace(enabled=True) and axis == q.axis:
        q.enabled = cfg.enabled  # only switched on or off: keep amax and statistics
        q.config = cfg
        return
    q.config, q.axis, q.enabled = cfg, axis, cfg.enabled
    q.histogram = q.histogram and axis is None  # activations keep their histogram (every method available)
    q.amax = None
    q.calibrator = None


def quantize(model: nn.Module, config: Mapping[str, Any], forward_loop: ForwardLoop | None = None) -> nn.Module:
    """ModelOpt's ``mtq.quantize(model, config, forward_loop)``: quant.quantize's layer swap, then each quantizer
    set from ``config["quant_cfg"]``, weights max-calibrated and ``forward_loop(model)`` run once for the
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
    for pattern, value in config["quant_cfg"].items():  # refuse bad entries before the model is touched
        for p, v in (value.items() if str(pattern).startswith("nn.") and isinstance(value, Mapping)
                     and all(isinstance(x, Mapping) for x in value.values()) else [(pattern, value)]):
            # (axis is checked per quantizer below: whether it fits depends on the layer)
            _quantizer_config(str(p), {"enable": True, "num_bits": 8, "narrow_range": False,
                                       **_check_entry(str(p), v), "axis": None}, weight_axis=None)
    alpha = _smoothquant_alpha(config.get("algorithm", "max"))
    model = api.quantize(model, QuantConfig(residual_add=False, smoothquant=alpha), forward_loop=None)
    set_quantizer_by_cfg(model, config["quant_cfg"])
    if alpha is not None and forward_loop is not None:
        from overdrive.quant.smoothquant import smooth

        model._overdrive_quant["smoothed"] = smooth(model, forward_loop, alpha)
    api._calibrate_weights(model)
    if forward_loop is not None and method is not None and any(q.enabled for q in api._activation_quantizers(model)):
        api.calibrate(model, forward_loop, method=method)
    return model


def calibrate(model: nn.Module, algorithm: Any = "max", forward_loop: ForwardLoop | None = None) -> nn.Module:
    """ModelOpt's ``mtq.calibrate``: recalibrate the activations of a quantized model with ``forward_loop``."""
    method = _method(algorithm)
    if forward_loop is not None and method is not None:
        api.calibrate(model, forward_loop, method=method)
    return model


def _select(model: nn.Module, wildcard_or_filter: str | Callable[[str], bool]) -> list[TensorQuantizer]:
    match = wildcard_or_filter if callable(wildcard_or_filter) else (
        lambda n: fnmatch.fnmatch(n, wildcard_or_filter))  # type: ignore[arg-type]
    return [q for n, q in api.quantizers(model) if match(n)]


def disable_quantizer(model: nn.Module, wildcard_or_filter: str | Callable[[str], bool]) -> None:
    """Turn off the quantizers whose names match (fnmatch pattern, or a function of the name)."""
    for q in _select(model, wildcard_or_filter):
        q.enabled = False


def enable_quantizer(model: nn.Module, wildcard_or_filter: str | Callable[[str], bool]) -> None:
    """Turn on the quantizers whose names match (fnmatch pattern, or a function of the name)."""
    for q in _select(model, wildcard_or_filter):
        q.enabled = True


def print_quant_summary(model: nn.Module) -> None:
    """One line per quantizer (name, format, axis, amax), then the count, as ModelOpt prints it; the table with
    skipped layers and why is quant.print_summary(model)."""
    qs = list(api.quantizers(model))
    width = max((len(n) for n, _ in qs), default=0)
    for name, q in qs:
        print(f"{name:<{width}}  TensorQuantizer({q.extra_repr()})")
    print(f"{len(qs)} TensorQuantizers found in model")


__all__ = ["INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT8_WEIGHT_ONLY_CFG", "quantize", "calibrate",
           "set_quantizer_by_cfg", "disable_quantizer", "enable_quantizer", "print_quant_summary"]
