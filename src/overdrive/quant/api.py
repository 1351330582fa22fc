"""The public verbs: quantize (PTQ), calibration, summary, calibrator comparison, sensitivity and
partial quantization (the QAT recipe on overdrive.train.Trainer is overdrive.recipes.quant.qat).

Example:
    >>> import torch
    >>> from overdrive import quant
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    >>> model = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(16, 8)))
    >>> type(model[0]).__name__, model[0].input_quantizer.is_calibrated
    ('QuantLinear', True)
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant import fidelity as fid
from overdrive.quant.config import QuantConfig, check_percentile
from overdrive.quant.modules import (
    GRAPH_QUANT_MODULES,
    QUANT_MODULES,
    QuantAdd,
    QuantMatmul,
    QuantSDPA,
    _QuantMixin,
    grouped_transpose_reason,
    insert_graph_quantizers,
    quant_class,
)
from overdrive.quant.quantizer import TensorQuantizer
from overdrive.quant.modules import eval_mode  # noqa: F401 - quant.api.eval_mode, as before

ForwardLoop = Callable[[nn.Module], Any]


def _selected(name: str, mod: nn.Module, config: QuantConfig, type_name: str | None = None) -> str | None:
    """None if ``mod`` is to be quantized, else the reason it is skipped (``type_name``: the layer
    type to check against ``config.layer_types``, default the module's own class name)."""
    type_name = type_name or type(mod).__name__
    if type_name not in config.layer_types:
        return f"type {type_name} not in layer_types"
    if not any(fnmatch.fnmatch(name, p) for p in config.include):
        return "not matched by include"
    hit = next((p for p in config.exclude if fnmatch.fnmatch(name, p)), None)
    if hit:
        return f"excluded by pattern {hit!r}"
    return grouped_transpose_reason(mod, config)


def _subclass_reason(name: str, mod: nn.Module, config: QuantConfig) -> str | None:
    """Why a subclass of a quantizable layer (``class MyLinear(nn.Linear)``) stays in float, or None
    when ``mod`` is not such a subclass.

    A class swap to QuantLinear would replace the subclass's own forward and methods, so it is
    never swapped; it is reported instead of being passed over in silence."""
    if isinstance(mod, _QuantMixin) or type(mod) in QUANT_MODULES:
        return None
    base = next((b for b in QUANT_MODULES if isinstance(mod, b)), None)
    if base is None:
        return None
    reason = _selected(name, mod, config, type_name=base.__name__)
    if reason is not None:
        return f"{reason} ({type(mod).__name__} subclasses nn.{base.__name__})"
    if type(mod).__name__ == "NonDynamicallyQuantizableLinear":
        # nn.MultiheadAttention's out_proj: F.multi_head_attention_forward reads out_proj.weight (and the packed
        # in_proj_weight) itself and never calls the layer, so no module swap can quantize it (ModelOpt and
        # pytorch-quantization leave it in float too)
        return ("nn.MultiheadAttention's out_proj: its forward (F.multi_head_attention_forward) uses out_proj.weight "
                "and in_proj_weight directly and never calls a Linear, so it stays in float; to quantize attention, "
                "write it with nn.Linear q/k/v/out projections (as Hugging Face models are) and use "
                "QuantConfig(quantize_matmuls=True) for its matmuls")
    return (f"{type(mod).__name__} subclasses nn.{base.__name__}: not swapped, a swap to Quant{base.__name__} would "
            f"drop its own forward and methods; to quantize it, replace it by a plain nn.{base.__name__} sharing its "
            "weight and bias before quant.quantize, or call TensorQuantizers on its input and weight in its forward")


def _recurrent_reason(mod: nn.Module) -> str | None:
    """Why an LSTM / GRU / RNN (or cell) stays in float, None for other modules. Its gate matmuls run inside torch's
    fused recurrent kernel on ``weight_ih_l0`` / ``weight_hh_l0``, with no layer call for a swap to reach; it is
    listed so that a model whose LSTM stays float does not look fully quantized."""
    if not isinstance(mod, (nn.RNNBase, nn.RNNCellBase)):
        return None
    return (f"{type(mod).__name__}: recurrent layers are not quantized (their gate matmuls run inside torch's fused "
            "kernel, which no layer swap reaches); it stays in float")


def _swap(module: nn.Module, config: QuantConfig, prefix: str, skipped: dict[str, str],
          done: dict[int, tuple[nn.Module, nn.Module]]) -> None:
    """Swap the selected layers below ``module`` in place, recording the others in ``skipped``.

    ``done`` maps id(original) to (original, replacement) for every module already visited, so a
    module registered under several names (``self.b = self.a``) is swapped once and every name then
    points to the same quantized module; the first name in module order decides its selection.
    """
    # _modules, not named_children(): named_children() lists a shared module under its first name only
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        full = prefix + name
        if id(child) in done:
            replacement = done[id(child)][1]
            if replacement is not child:
                setattr(module, name, replacement)
            continue
        done[id(child)] = (child, child)  # the original is kept alive so its id is not reused
        cls = quant_class(child)
        if cls is not None:
            reason = _selected(full, child, config)
            if reason is None:
                new = cls.from_float(child, config)
                done[id(child)] = (child, new)
                setattr(module, name, new)
                continue
            skipped[full] = reason
        elif isinstance(child, _QuantMixin):
            continue
        elif _recurrent_reason(child) is not None:
            skipped[full] = _recurrent_reason(child)  # type: ignore[assignment]
            continue
        else:
            reason = _subclass_reason(full, child, config)
            if reason is not None:
                skipped[full] = reason
        _swap(child, config, full + ".", skipped, done)


def _run_submodules(module: nn.Module, args: tuple[Any, ...]) -> None:
    """A forward pre-hook that changes nothing: its presence makes ``nn.TransformerEncoderLayer`` take its
    module-by-module path (see :func:`_keep_layers_called`)."""
    return None


def _keep_layers_called(model: nn.Module) -> None:
    """Make torch's fused Transformer encoder kernels call the quantized layers instead of reading their weights.

    In eval mode without gradients (``torch.no_grad()``, ``inference_mode``: calibration and most inference),
    ``nn.TransformerEncoderLayer`` runs ``torch._transformer_encoder_layer_fwd`` on ``linear1.weight`` /
    ``linear2.weight`` and never calls those layers, so their quantizers are skipped: calibration never reaches
    them, and the quantized model silently computes them in float. The layer keeps its own forward when a hook is
    attached, so each encoder layer holding a quantized layer gets the no-op :func:`_run_submodules`; an
    ``nn.TransformerEncoder`` over such layers stops packing a padded batch into a nested tensor
    (``use_nested_tensor = False``, the value torch sets itself for layers its fast path cannot take), which the
    quantizers' per-tensor ranges cannot read. The results are those of the layers' training-mode path.
    """
    for m in model.modules():
        if not any(isinstance(c, (_QuantMixin, TensorQuantizer)) for c in m.modules() if c is not m):
            continue
        if isinstance(m, nn.TransformerEncoderLayer) and _run_submodules not in m._forward_pre_hooks.values():
            m.register_forward_pre_hook(_run_submodules)
        elif isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False


def quantizers(model: nn.Module) -> Iterable[tuple[str, TensorQuantizer]]:
    """(name, quantizer) for every TensorQuantizer in ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer):
            yield name, m


def quantize(model: nn.Module, config: QuantConfig, forward_loop: ForwardLoop | None = None, *,
             validate: Callable[[nn.Module], float] | None = None, fidelity: bool = True) -> nn.Module:
    """Insert quantizers (ModelOpt-style) and calibrate them by running ``forward_loop(model)``.

    What it did to your model is measured on your data: with ``forward_loop``, the outputs on its first
    calibration batches against the same model with every quantizer off (``summary(model)["fidelity"]``:
    cosine, max error, top-1; ``fidelity=False`` skips those extra forward passes); with ``validate``, your
    metric (``validate(model) -> float``, e.g. accuracy on a held-out set) on the float model and on the
    quantized one (``summary(model)["validate"]``: float, quantized, delta). ``print_summary`` prints both.

    Swaps selected Linear/Conv/ConvTranspose2d layers for quantized ones (same parameters), adds
    residual-add quantizers with torch.fx when ``config.residual_add`` and attention-matmul
    quantizers (QK^T, PV, SDPA's q/k/v) when ``config.quantize_matmuls``, computes weight amax
    (per channel), then runs ``forward_loop`` once in calibration mode and sets every activation
    amax with ``config.method``. Without ``forward_loop`` the activation quantizers stay
    uncalibrated (running, exporting or converting then raises). Returns the model (modified in
    place, except a root module that adds tensors itself is returned as a traced copy: an object of
    a subclass of its class with the same parameters, buffers, attributes and methods). A module
    registered under several names is quantized once and every name points to the quantized one.
    Subclasses of Linear/Conv (own forward) stay float and are listed in ``summary()['skipped']``.

    Example:
        >>> from overdrive.quant import INT8_DEFAULT
        >>> m = quantize(torch.nn.Linear(4, 2), INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(8, 4)))
        >>> type(m).__name__
        'QuantLinear'
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}; pass the float model itself")
    if not isinstance(config, QuantConfig):
        raise UsageError(f"config must be a quant.QuantConfig (e.g. quant.INT8_DEFAULT), got {type(config).__name__}")
    if forward_loop is not None:
        _check_forward_loop(forward_loop)
    if any(True for _ in quantizers(model)):
        raise UsageError("this model already has quantizers (from an earlier quantize() or placed by hand); call "
                         "quantize() on the float model, or quant.calibrate(model, forward_loop) to calibrate the "
                         "quantizers it has")
    before = fid.validated(validate, model)  # the float model's own figure, before any layer is swapped
    names = {n for n, _ in model.named_modules(remove_duplicate=False)}  # what include / exclude can match
    skipped: dict[str, str] = {}
    cls = quant_class(model)
    if cls is not None:  # a bare layer
        reason = _selected("", model, config)
        if reason is None:
            model = cls.from_float(model, config)
        else:
            skipped["<root>"] = reason
    else:
        reason = _subclass_reason("", model, config) or _recurrent_reason(model)
        if reason is not None:
            skipped["<root>"] = reason
        _swap(model, config, "", skipped, {})
    untraced: list[str] = []
    left_out: list[str] = []
    if (config.residual_add or config.quantize_matmuls) and cls is None:
        model, _, untraced = insert_graph_quantizers(model, config, left_out=left_out)
    _keep_layers_called(model)
    _warn_unmatched_patterns(config, names | set(left_out) | {n for n, _ in model.named_modules()})
    for name, q in quantizers(model):
        q.name = name
    model._overdrive_quant = {"config": config, "skipped": skipped, "untraced": untraced}  # read by print_summary
    # the inputs of ONE pass over forward_loop are kept for the fidelity record: SmoothQuant's statistics pass when
    # there is one (a second capture during calibration would keep every batch twice), else the calibration pass
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    capturing = fidelity and forward_loop is not None
    if config.smoothquant is not None and forward_loop is not None:
        from overdrive.quant.smoothquant import smooth

        with fid.capture(model) if capturing else contextlib.nullcontext([]) as calls:
            model._overdrive_quant["smoothed"] = smooth(model, forward_loop, config.smoothquant)
    _calibrate_weights(model)
    with fid.capture(model) if capturing and not calls else contextlib.nullcontext(calls) as calls:
        if forward_loop is not None:
            if not _activation_quantizers(model):  # calibrate() would say "call quant.quantize first"
                found = "; ".join(f"{n}: {why}" for n, why in skipped.items()) or f"no layer of types {config.layer_types}"
                raise UsageError(f"quantize() found no layer to quantize ({found[:500]}); check the model and "
                                 "QuantConfig's layer_types / include / exclude")
            calibrate(model, forward_loop, method=config.method, percentile=config.percentile)
        if capturing and not calls:  # dynamic / weight-only: calibration ran no batch
            fid.run_until_captured(model, forward_loop)
    if calls:
        model._overdrive_quant["fidelity"] = fid.measure(model, calls)
    if validate is not None:
        after = fid.validated(validate, model)
        model._overdrive_quant["validate"] = {"float": before, "quantized": after, "delta": after - before}
    return model


def _check_forward_loop(forward_loop: object) -> None:
    """A UsageError unless ``forward_loop`` is a function taking the model (not the batches themselves)."""
    hint = "e.g. forward_loop=lambda m: [m(x) for x in batches]"
    if not callable(forward_loop):
        raise UsageError(f"forward_loop must be a function that runs the model on calibration batches, got a "
                         f"{type(forward_loop).__name__}; {hint}")
    try:
        params = inspect.signature(forward_loop).parameters.values()
    except (TypeError, ValueError):  # builtins and some callables have no signature: trust them
        return
    if not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        raise UsageError(f"forward_loop {getattr(forward_loop, '__name__', forward_loop)!r} takes no argument; it is "
                         f"called with the model to calibrate, {hint}")


def _warn_unmatched_patterns(config: QuantConfig, names: set[str]) -> None:
    """Warn for each include / exclude pattern that matches no module name (fnmatch against the full dotted
    name: ``exclude=("head",)`` does not match ``decoder.head``), so a layer meant to stay float is not quantized
    in silence."""
    for field, patterns in (("exclude", config.exclude), ("include", config.include)):
        for pat in patterns:
            if pat == "*" or any(fnmatch.fnmatch(n, pat) for n in names):
                continue
            near = sorted(n for n in names if n and fnmatch.fnmatch(n.rsplit(".", 1)[-1], pat))[:3]
            hint = f"; patterns match the full dotted name, e.g. {near}" if near else ""
            warnings.warn(f"QuantConfig {field} pattern {pat!r} matches no module of this model, so it changes "
                          f"nothing{hint}", UserWarning, stacklevel=3)


def _calibrate_weights(model: nn.Module, missing_only: bool = False) -> None:
    """Weight amax = max |weight| (per channel where configured); ``missing_only``: uncalibrated ones only."""
    for m in model.modules():
        if (isinstance(m, _QuantMixin) and m.weight_quantizer.enabled
                and not (missing_only and m.weight_quantizer.is_calibrated)):
            w = m.weight.detach()
            if not bool(torch.isfinite(w).all()):
                raise UsageError(f"the weight of {m.weight_quantizer.name.rsplit('.', 1)[0]} has NaN/inf values; "
                                 "fix the checkpoint before quantizing")
            m.weight_quantizer.start_calibration()
            # amax of the weight as it is quantized: after SmoothQuant's factor where there is one
            m.weight_quantizer.calibrator.collect(m.weight_quantizer.apply_pre_quant_scale(w), m.weight_quantizer.name)
            m.weight_quantizer.finish_calibration()


def _activation_quantizers(model: nn.Module) -> list[TensorQuantizer]:
    """The quantizers calibrated on forward data: every one except the weight quantizers of quantized layers,
    whose amax is max |weight| (:func:`_calibrate_weights`). A custom module's own weight quantizer (ModelOpt's
    ``mtq.register``, pytorch-quantization's ``QuantMixin``) sees its weight in forward and is calibrated there,
    as in those libraries."""
    weights = {id(m.weight_quantizer) for m in model.modules() if isinstance(m, _QuantMixin)}
    return [q for _, q in quantizers(model) if id(q) not in weights]


def calibrate(model: nn.Module, forward_loop: ForwardLoop, method: str = "max", percentile: float | None = 99.99) -> nn.Module:
    """Run ``forward_loop(model)`` once with every enabled activation quantizer observing, then set amax.

    Disabled quantizers (``QuantizerConfig(enabled=False)``, :func:`partial_quantize`) are left
    alone: they observe nothing and keep their amax and statistics. With no enabled activation
    quantizer (weight-only configs) there is nothing to calibrate and ``forward_loop`` is not run.
    Histograms are kept, so :func:`load_calib_amax` can switch method later without data.
    Quantizers placed by hand (quantized layers built directly, a ``TensorQuantizer`` in a module's own
    forward) are calibrated too: unnamed ones get their module name, and uncalibrated weight quantizers of
    quantized layers get max |weight|.
    """
    _calibrate(model, forward_loop, method, percentile, strict=True)
    return model


@torch.no_grad()
def _calibrate(model: nn.Module, forward_loop: ForwardLoop, method: str, percentile: float | None,
               strict: bool) -> list[str]:
    """:func:`calibrate`; returns the names of the activation quantizers ``forward_loop`` never reached. ``strict``
    raises for them (before any amax changes); otherwise, unless it reached none, they keep their amax and
    statistics (uncalibrated ones stay so) and the others are calibrated, as ModelOpt's calibration skips a
    quantizer that saw no data."""
    _check_forward_loop(forward_loop)
    for name, q in quantizers(model):
        q.name = q.name or name
    _calibrate_weights(model, missing_only=True)
    acts = _activation_quantizers(model)
    if not acts:
        raise UsageError("the model has no activation quantizers; call quant.quantize(model, config) first")
    acts = [q for q in acts if q.enabled and not q.dynamic]  # dynamic ones bring their scales with each input
    if not acts:
        return []
    previous = [q.calibrator for q in acts]
    # the activations are observed in the float network, as ModelOpt, pytorch-quantization and TensorRT calibrate:
    # the weight quantizers pass values through meanwhile (they quantized the weights the activations saw)
    weights = [m.weight_quantizer for m in model.modules()
               if isinstance(m, _QuantMixin) and m.weight_quantizer.quant_enabled]
    with eval_mode(model):
        for q in acts:
            q.start_calibration()
        for q in weights:
            q.quant_enabled = False
        try:
            forward_loop(model)
        except BaseException:
            # a forward_loop that fails midway leaves partial statistics: put back the previous ones
            # (amax was not touched), so load_calib_amax / compare_calibrators do not use half a pass
            for q, cal in zip(acts, previous):
                q.calibrator = cal
            raise
        finally:
            for q in acts:
                q.calibrating = False
            for q in weights:
                q.quant_enabled = True
    unseen = [(q, cal) for q, cal in zip(acts, previous) if q.calibrator is None or
              (getattr(q.calibrator, "hist", None) is None and not getattr(q.calibrator, "_zeros", 0)
               and getattr(q.calibrator, "amax", None) is None)]
    missing = [q.name for q, _ in unseen]
    if missing and (strict or len(missing) == len(acts)):  # reaching none is a forward_loop that runs no batch
        layers = sorted({n.rsplit(".", 1)[0] for n in missing[:5] if "." in n})
        raise UsageError(f"forward_loop never reached quantizer(s) {missing[:5]}; it must call the model on "
                         "calibration batches, e.g. forward_loop=lambda m: [m(x) for x in batches]; layers that "
                         f"forward does not use (an auxiliary head) can be left in float with "
                         f"QuantConfig(exclude={tuple(layers)!r})")
    for q, cal in unseen:  # their earlier statistics (if any) stay: an empty pass is no calibration
        q.calibrator = cal
    skip = frozenset(id(q) for q, _ in unseen)
    _load_calib_amax(model, method, percentile, skip)
    for q in _activation_quantizers(model):  # all-zero inputs, outliers that leave int8 no range: say so
        if q.enabled and q.is_calibrated and id(q) not in skip:
            q.warn_if_degenerate()
    return missing


def load_calib_amax(model: nn.Module, method: str = "max", percentile: float | None = 99.99) -> None:
    """Recompute every enabled activation amax from the stored histograms with ``method`` (no data).

    Disabled quantizers are skipped: they need no statistics and keep their amax.
    """
    _load_calib_amax(model, method, percentile, skip=frozenset())


def _load_calib_amax(model: nn.Module, method: str, percentile: float | None, skip: frozenset[int]) -> None:
    """:func:`load_calib_amax`, leaving out the quantizers whose id is in ``skip``."""
    if method not in ("max", "percentile", "entropy", "mse"):
        raise UsageError(f"calibration method {method!r} is not one of max, percentile, entropy, mse")
    if method == "percentile" and percentile is not None:
        check_percentile(percentile)  # before any quantizer is changed
    for q in _activation_quantizers(model):
        if q.enabled and id(q) not in skip:
            q.load_calib_amax(method, percentile)


def set_quantizers_enabled(model: nn.Module, enabled: bool, names: Sequence[str] | None = None) -> None:
    """Turn the quantizers of the layers named in ``names`` (all layers if None; a string is one name) on or off."""
    owners = {n: m for n, m in model.named_modules() if isinstance(m, (_QuantMixin, *GRAPH_QUANT_MODULES))}
    if isinstance(names, str):  # one layer's name, not its characters
        names = (names,)
    if names is not None:
        unknown = [n for n in names if n not in owners]
        if unknown:
            raise UsageError(f"no quantized layer named {unknown}; quantized layers: {list(owners)[:10]}...")
        owners = {n: owners[n] for n in names}
    for m in owners.values():
        for q in m.children():
            if isinstance(q, TensorQuantizer):
                q.enabled = enabled


def quantized_layers(model: nn.Module) -> list[str]:
    """Names of the quantized layers, residual adds and attention matmuls, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, (_QuantMixin, *GRAPH_QUANT_MODULES))]


@dataclass
class SummaryRow:
    name: str
    kind: str
    input_amax: float | None
    weight_amax: str
    enabled: bool
    dynamic: bool = False  # input scales per token at run time: no input amax


def summary(model: nn.Module) -> dict[str, Any]:
    """What print_summary shows, as data: quantized layers with amax, skipped layers and why."""
    rows = []
    for name, m in model.named_modules():
        if isinstance(m, _QuantMixin):
            iq, wq = m.input_quantizer, m.weight_quantizer
            w = "-" if wq.amax is None else (f"{float(wq.amax.min()):.4g}..{float(wq.amax.max()):.4g}"
                                               if wq.amax.dim() else f"{float(wq.amax):.4g}")
            rows.append(SummaryRow(name, type(m).__name__, None if iq.amax is None else float(iq.amax), w,
                                   iq.enabled or wq.enabled, dynamic=iq.dynamic))
        elif isinstance(m, QuantAdd):
            q = m.residual_quantizer
            rows.append(SummaryRow(name, "QuantAdd (residual input)", None if q.amax is None else float(q.amax), "-",
                                   q.enabled))
        elif isinstance(m, (QuantMatmul, QuantSDPA)):
            # input amax column: the first operand (A of A @ B, or q); the other operands are named
            qs = ([m.input_quantizer, m.other_quantizer] if isinstance(m, QuantMatmul)
                  else [m.q_quantizer, m.k_quantizer, m.v_quantizer])
            labels = ["B"] if isinstance(m, QuantMatmul) else ["k", "v"]
            others = ", ".join(f"{lab} {'-' if q.amax is None else f'{float(q.amax):.4g}'}"
                               for lab, q in zip(labels, qs[1:]))
            kind = f"QuantMatmul ({m.op}: A @ B)" if isinstance(m, QuantMatmul) else "QuantSDPA (q, k, v)"
            rows.append(SummaryRow(name, kind, None if qs[0].amax is None else float(qs[0].amax), others,
                                   any(q.enabled for q in qs)))
    meta = getattr(model, "_overdrive_quant", {})
    zero = [r.name for r in rows if r.input_amax == 0.0]
    smoothed = [n for n, m in model.named_modules()
                if isinstance(m, _QuantMixin) and m.input_quantizer.pre_quant_scale is not None]
    return {"layers": rows, "skipped": meta.get("skipped", {}), "untraced": meta.get("untraced", []),
            "all_zero_inputs": zero, "smoothed": smoothed, "config": meta.get("config"),
            "fidelity": meta.get("fidelity"), "validate": meta.get("validate")}


def print_summary(model: nn.Module, console: Any = None) -> None:
    """Print the quantized layers with their amax, the layers left in float and why.

    Example:
        >>> # quant.print_summary(model)
    """
    from rich.console import Console
    from rich.table import Table

    s = summary(model)
    t = Table(title="overdrive.quant summary")
    for c in ("layer", "kind", "input amax", "weight / other amax", "quantized"):
        t.add_column(c)
    for r in s["layers"]:
        t.add_row(r.name, r.kind, "dynamic" if r.dynamic else "-" if r.input_amax is None else f"{r.input_amax:.4g}",
                  r.weight_amax,
                  "yes" if r.enabled else "no (float)")
    for name, why in s["skipped"].items():
        t.add_row(name, "skipped", "-", "-", why)
    out = console or Console(highlight=False)
    out.print(t)
    if s["untraced"]:
        out.print(f"adds / matmuls not quantized (torch.fx could not trace): {s['untraced']}")
    if s["smoothed"]:
        out.print(f"SmoothQuant factors on {len(s['smoothed'])} layer(s)")
    if s["all_zero_inputs"]:
        out.print(f"all-zero activations seen at: {s['all_zero_inputs']} (amax 0: these inputs quantize to 0)")
    for line in fid.describe(s["fidelity"], s["validate"]):
        out.print(line)


# --- choosing and repairing ------------------------------------------------------------------
CALIBRATORS: tuple[tuple[str, float | None], ...] = (
    ("max", None), ("percentile", 99.9), ("percentile", 99.99), ("percentile", 99.999), ("entropy", None), ("mse", None),
)


def compare_calibrators(model: nn.Module, eval_fn: Callable[[nn.Module], float],
                        methods: Sequence[tuple[str, float | None]] = CALIBRATORS, apply_best: bool = True) -> list[dict[str, Any]]:
    """Evaluate every calibration method from the stored histograms; apply the best (highest eval_fn).

    Example:
        >>> # rows = quant.compare_calibrators(model, lambda m: accuracy(m, test_loader))
    """
    rows = []
    for method, pct in methods:
        load_calib_amax(model, method, pct)
        label = f"percentile {pct}" if method == "percentile" else method
        rows.append({"method": method, "percentile": pct, "label": label, "metric": float(eval_fn(model))})
    if apply_best and rows:
        best = max(rows, key=lambda r: r["metric"])
        load_calib_amax(model, best["method"], best["percentile"])
        for r in rows:
            r["best"] = r is best
    return rows


def sensitivity(model: nn.Module, eval_fn: Callable[[nn.Module], float]) -> list[dict[str, Any]]:
    """Quantize one layer at a time (others float); rank layers by the metric's drop, worst first."""
    layers = quantized_layers(model)
    saved = {n: q.enabled for n, q in quantizers(model)}
    set_quantizers_enabled(model, False)
    base = float(eval_fn(model))
    rows = []
    try:
        for name in layers:
            set_quantizers_enabled(model, True, [name])
            rows.append({"layer": name, "metric": float(eval_fn(model)), "drop": 0.0})
            rows[-1]["drop"] = base - rows[-1]["metric"]
            set_quantizers_enabled(model, False, [name])
    finally:
        for n, q in quantizers(model):
            q.enabled = saved[n]
    return sorted(rows, key=lambda r: -r["drop"])


def partial_quantize(model: nn.Module, ranking: Sequence[dict[str, Any]], k: int) -> list[str]:
    """Keep the ``k`` most sensitive layers of ``ranking`` (from :func:`sensitivity`) in float."""
    if k < 0:
        raise UsageError(f"k={k} must be >= 0")
    names = [r["layer"] for r in ranking[:k]]
    if names:
        set_quantizers_enabled(model, False, names)
    return names


@torch.no_grad()
def smoothed_float(model: nn.Module, forward_loop: Callable[[nn.Module], Any], alpha: float = 0.5) -> nn.Module:
    """A float copy of ``model`` in which every Linear (and GPT-2 ``Conv1D``) that ``forward_loop`` reaches is a
    :class:`SmoothedLinear` with SmoothQuant factors at ``alpha`` from the activations it saw: the same function,
    ready for dynamic int8 (``quant.dynamic_int8``, ONNX Runtime's ``quantize_dynamic``). ``model`` is not changed;
    ``result._overdrive_smoothed`` lists the smoothed layers.

    Example:
        >>> m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> sm = smoothed_float(m, lambda mm: mm(torch.randn(16, 8)))
        >>> [type(x).__name__ for x in sm], sm._overdrive_smoothed
        (['SmoothedLinear', 'ReLU', 'SmoothedLinear'], ['0', '2'])
    """
    import copy

    from overdrive.quant.config import INT8_DYNAMIC, check_alpha
    from overdrive.quant.modules import hf_conv1d_class
    from overdrive.quant.real import _set
    from overdrive.quant.smoothquant import SmoothedLinear

    q = quantize(copy.deepcopy(model), INT8_DYNAMIC.replace(smoothquant=check_alpha(alpha)), forward_loop=forward_loop)
    conv1d = hf_conv1d_class()
    done: list[str] = []
    for name, m in list(q.named_modules()):
        if not isinstance(m, _QuantMixin):
            continue
        inv_s = m.input_quantizer.pre_quant_scale
        if inv_s is None:
            new: nn.Module = m.to_float()
        else:
            w = m.weight_quantizer.apply_pre_quant_scale(m.weight.detach())
            new = SmoothedLinear(w.t() if conv1d is not None and isinstance(m, conv1d) else w, m.bias, inv_s)
            done.append(name)
        if name == "":
            q = new
            break
        _set(q, name, new)
    if hasattr(q, "_overdrive_quant"):
        del q._overdrive_quant
    q._overdrive_smoothed = done
    return q
