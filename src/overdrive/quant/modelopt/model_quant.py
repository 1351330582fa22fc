"""ModelOpt's ``modelopt.torch.quantization.model_quant``: the verbs a script calls on a model (``mtq.quantize``,
``mtq.calibrate``, ``mtq.postprocess_amax``, ``mtq.fold_weight``, ``mtq.disable_quantizer`` /
``mtq.enable_quantizer``, ``mtq.print_quant_summary``), over overdrive.quant's ``quantize`` / ``calibrate``.

Example:
    >>> import torch, overdrive.quant.modelopt as mtq
    >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG,
    ...                  lambda m: m(torch.ones(2, 4)))
    >>> float(m[0].input_quantizer.amax)
    1.0
"""

from __future__ import annotations

import fnmatch
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant import api
from overdrive.quant.config import QuantConfig
from overdrive.quant.modelopt.conversion import _apply, _checked_rules, _insert_quantizers
from overdrive.quant.modules import _QuantMixin
from overdrive.quant.quantizer import TensorQuantizer

ForwardLoop = Callable[[torch.nn.Module], Any]

_NOT_IMPLEMENTED = {
    "awq": "AWQ is not implemented in overdrive.quant; for 4-bit weights use quant.weight_only(model, bits=4, "
           "group_size=128) (round-to-nearest, per-group scales)",
}


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
    _refuse_quantized(model)
    alpha = _smoothquant_alpha(config.get("algorithm", "max"))
    model = _insert_quantizers(model, QuantConfig(residual_add=False, smoothquant=alpha))
    _apply(model, quant_rules, fresh=True)
    if alpha is not None and forward_loop is not None:
        from overdrive.quant.smoothquant import smooth

        model._overdrive_quant["smoothed"] = smooth(model, forward_loop, alpha)
    api._calibrate_weights(model)
    if forward_loop is not None and method is not None and any(q.enabled for q in api._activation_quantizers(model)):
        _calibrate_activations(model, forward_loop, method)
    return model


def _refuse_quantized(model: torch.nn.Module) -> None:
    """A UsageError when ``model`` has quantizers already; ModelOpt refuses such a model too ("Model must not be
    quantized!"). The message names the quantizers found and where they came from: an earlier quantize (its
    record is on the model) or built by hand (TensorQuantizers or quantized layers in the model's own code)."""
    found = [n for n, _ in api.quantizers(model)]
    if not found:
        return
    shown = ", ".join(found[:4]) + (f" (and {len(found) - 4} more)" if len(found) > 4 else "")
    if hasattr(model, "_overdrive_quant"):
        raise UsageError(f"this model already has quantizers ({shown}) from an earlier mtq.quantize / quant.quantize; "
                         "mtq.quantize takes the float model (ModelOpt refuses a quantized one too); to calibrate "
                         "again call mtq.calibrate(model, algorithm='max', forward_loop=forward_loop), to change "
                         "formats or switch quantizers call mtq.set_quantizer_by_cfg(model, cfg['quant_cfg']) and "
                         "then mtq.calibrate")
    raise UsageError(f"this model has quantizers built by hand ({shown}: TensorQuantizer modules or quantized layers "
                     "in the model's own code); mtq.quantize takes a model without quantizers (ModelOpt refuses this "
                     "one too: 'Model must not be quantized!'). Either create them in a quantized class: "
                     "mtq.register(original_cls=MyBlock, quantized_cls=QuantMyBlock), whose _setup() makes the "
                     "TensorQuantizers its forward calls, and mtq.quantize then inserts, configures (quant_cfg) and "
                     "calibrates them; or keep them, set them with mtq.set_quantizer_by_cfg(model, cfg['quant_cfg']) "
                     "and calibrate them with mtq.calibrate(model, 'max', forward_loop)")


def _calibrate_activations(model: torch.nn.Module, forward_loop: ForwardLoop, method: str) -> None:
    """api.calibrate as ModelOpt calibrates: a quantizer the forward loop never reached (a layer its forward
    skips: a pooler, an unused head) is left as it was, with a warning, instead of stopping the calibration."""
    missing = api._calibrate(model, forward_loop, method, 99.99, strict=False)
    if missing:
        layers = sorted({n.rsplit(".", 1)[0] for n in missing if "." in n})
        entries = ", ".join(f"{{'quantizer_name': '{lay}.*', 'enable': False}}" for lay in layers[:3])
        warnings.warn(f"forward_loop never reached {len(missing)} quantizer(s) ({', '.join(missing[:5])}"
                      f"{', ...' if len(missing) > 5 else ''}); they keep the amax they had (none: uncalibrated, as ModelOpt "
                      "leaves them, and running those layers raises until they are calibrated); to keep them in float add "
                      f"{entries or '{...: enable False}'} to cfg['quant_cfg'] (or mtq.disable_quantizer)",
                      RuntimeWarning, stacklevel=3)


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
    """ModelOpt's ``mtq.calibrate``: every enabled weight quantizer gets the max |w| of the weight as it is now (after
    fine-tuning or a format / axis change), then the enabled activation quantizers are recalibrated with
    ``forward_loop`` (none given: weights only, activations keep their amax); ``algorithm`` None calibrates
    nothing. Returns the model.

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
    api._calibrate_weights(model)  # as ModelOpt's max_calibrate: weights are observed afresh, not kept
    if forward_loop is not None and any(q.enabled for q in api._activation_quantizers(model)):
        _calibrate_activations(model, forward_loop, method)
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
