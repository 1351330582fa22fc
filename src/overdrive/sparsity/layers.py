"""Which weights of a model can be pruned to 2:4, and why others are skipped.

The rule (cuSPARSELt / sparse tensor core GEMM constraints, as apex ASP applies them): a weight
viewed as a GEMM operand (out, in) is pruned when ``out % 8 == 0`` and ``in % 16 == 0`` (``in`` is
input channels for convolutions, whose groups of 4 run along them), and convolutions are not
grouped (a grouped conv is a batch of small GEMMs whose reduction dimension is ``in / groups``).

transformers' ``Conv1D`` (GPT-2's attention and MLP layers: y = x @ W + b with W stored (in, out)) is pruned as
the Linear it is, with its groups of 4 along ``in``, which is dim 0 of its weight (``Candidate.transposed``).

Weights that look prunable but are not, are reported as skipped rather than passed over silently:
transposed convolutions, whose weights are stored (in, out, *k), and a weight tied to a module that is not a GEMM
layer (an ``nn.Embedding`` tied to the LM head), which pruning would zero in that module too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from overdrive._utils.errors import UsageError
from overdrive._utils.optional import hf_conv1d_class
from overdrive.sparsity.config import SparsityConfig, class_key

_TYPES: dict[str, type[nn.Module]] = {
    "Linear": nn.Linear, "Conv1d": nn.Conv1d, "Conv2d": nn.Conv2d, "Conv3d": nn.Conv3d,
    "MultiheadAttention": nn.MultiheadAttention,
}
OUT_MULTIPLE = 8
IN_MULTIPLE = 16


@dataclass
class Candidate:
    """One weight parameter considered for pruning: ``module.<param_name>`` named ``name``."""

    name: str  # e.g. "encoder.0.linear1.weight"
    module_name: str
    module: nn.Module
    param_name: str
    layer_type: str
    skip_reason: str | None = None
    transposed: bool = False  # the weight is stored (in, out): transformers' Conv1D


def is_conv1d_gemm(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (y = x @ W + b, W (in, out)) or a subclass (``QuantConv1D``).

    Example:
        >>> is_conv1d_gemm(nn.Linear(4, 4)), is_conv1d_gemm(nn.Conv1d(4, 4, 1))
        (False, False)
    """
    cls = hf_conv1d_class()
    return cls is not None and isinstance(module, cls)


def _kind(module: nn.Module, wanted: tuple[str, ...]) -> str | None:
    for key in wanted:
        if isinstance(module, _TYPES[key]):  # subclasses count (apex matched exact types only)
            return key
    if "Linear" in wanted and is_conv1d_gemm(module):  # a Linear stored transposed
        return "Conv1D"
    return None


def custom_params(module: nn.Module, custom: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[str, tuple[str, ...]] | None:
    """(layer type, parameter names) when ``module``'s class or a base of it is in ``SparsityConfig.custom_layers``
    (apex's ``custom_layer_dict``), else None.

    Example:
        >>> custom_params(nn.Bilinear(16, 16, 8), (("torch.nn.modules.linear.Bilinear", ("weight",)),))
        ('Bilinear', ('weight',))
    """
    if not custom:
        return None
    table = dict(custom)
    for cls in type(module).__mro__:
        names = table.get(class_key(cls))
        if names is not None:
            return type(module).__name__, names
    return None


def _layer(module: nn.Module, config: SparsityConfig) -> tuple[str, tuple[str, ...]] | None:
    """(layer type, names of the parameters to prune) for a layer the config selects, else None."""
    custom = custom_params(module, config.custom_layers)
    if custom is not None:
        return custom
    kind = _kind(module, config.layer_types)
    if kind is None:
        return None
    if kind == "MultiheadAttention":
        # out_proj is a Linear subclass and is found as its own module.
        return kind, (("in_proj_weight",) if module.in_proj_weight is not None
                      else ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
    return kind, ("weight",)


def shape_rule(shape: tuple[int, ...]) -> str | None:
    """Why a weight of ``shape`` cannot use sparse kernels, or None when it can."""
    out, inp = shape[0], shape[1]
    if out % OUT_MULTIPLE or inp % IN_MULTIPLE:
        return f"shape {tuple(shape)}: sparse GEMMs need out % {OUT_MULTIPLE} == 0 and in % {IN_MULTIPLE} == 0"
    return None


def _unsupported(module: nn.Module, wanted: tuple[str, ...]) -> tuple[str, str] | None:
    """(layer type, reason) for GEMM layers whose weight layout 2:4 pruning here does not handle."""
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and any(t.startswith("Conv") for t in wanted):
        return (type(module).__name__, "transposed convolution: its weight is (in, out, *k), the 2:4 groups would run "
                "along output channels; not supported, stays dense")
    return None


def _tied_elsewhere(model: nn.Module, config: SparsityConfig) -> dict[int, str]:
    """id(weight) -> name and type of a non-GEMM module (an Embedding tied to an LM head) holding it too."""
    out: dict[int, str] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        if _layer(module, config) is not None:
            continue
        for pname, p in module._parameters.items():
            if p is not None and p.dim() >= 2:
                out.setdefault(id(p), f"{mname + '.' if mname else ''}{pname} ({type(module).__name__})")
    return out


def _check_names(model: nn.Module, config: SparsityConfig) -> None:
    """Refuse an ``allowed_layer_names`` / ``disallowed_layer_names`` entry that names no module of ``model``: a typo
    (``"haed"``) or a parameter name (``"head.weight"``) in ``disallowed_layer_names`` pruned the layer it meant to keep
    dense, silently."""
    import difflib

    names = {n for n, _ in model.named_modules()}
    for field in ("allowed_layer_names", "disallowed_layer_names"):
        for name in getattr(config, field) or ():
            if name not in names:
                owner = name.rsplit(".", 1)[0] if "." in name else None  # a parameter's name: its module
                close = [owner] if owner in names else difflib.get_close_matches(name, sorted(names - {""}), n=3)
                hint = f"did you mean {close}?" if close else f"module names look like {sorted(names - {''})[:4]}"
                raise UsageError(f"SparsityConfig({field}=...) names {name!r}, which is not a module of "
                                 f"{type(model).__name__}; give module names as model.named_modules() lists them "
                                 f"({hint})")


def find_candidates(model: nn.Module, config: SparsityConfig) -> list[Candidate]:
    """Every weight of the configured layer types, with ``skip_reason`` set where it stays dense."""
    _check_names(model, config)
    out: list[Candidate] = []
    seen: set[int] = set()
    tied = _tied_elsewhere(model, config)
    # a weight two of these layers share (an encoder and a decoder tied): every layer holding it is judged, not only
    # the first met (a disallowed second layer was pruned through the first, silently)
    sharers: dict[int, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        found = _layer(module, config)
        if found is not None:
            for pname in (("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
                          if found[1][:1] == ("in_proj_weight",) else found[1]):
                p = getattr(module, pname, None)
                if isinstance(p, torch.Tensor) and mname not in sharers.setdefault(id(p), []):
                    sharers[id(p)].append(mname)
    for mname, module in model.named_modules():
        found = _layer(module, config)
        if found is None:
            unsupported = _unsupported(module, config.layer_types)
            w = getattr(module, "weight", None)
            if unsupported is not None and isinstance(w, torch.Tensor) and id(w) not in seen:
                seen.add(id(w))
                out.append(Candidate(f"{mname}.weight" if mname else "weight", mname, module, "weight", unsupported[0],
                                     unsupported[1]))
            continue
        kind, names = found
        if custom_params(module, config.custom_layers) is not None:  # a custom layer: the names given must exist
            missing = [n for n in names if not isinstance(getattr(module, n, None), torch.Tensor)]
            if missing:
                have = [n for n, _ in module.named_parameters(recurse=False)]
                raise UsageError(f"custom_layers names {missing} of {kind} ({mname!r}), which has no such tensor; "
                                 f"its own parameters are {have}")
        for pname in names:
            p = getattr(module, pname, None)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            cand = Candidate(full, mname, module, pname, kind, transposed=kind == "Conv1D")
            holders = sharers.get(id(p), [mname])
            others = [n for n in holders if n != mname]
            if config.allowed_layer_names is not None and not any(n in config.allowed_layer_names for n in holders):
                cand.skip_reason = "not in allowed_layer_names"
            elif mname in config.disallowed_layer_names:
                cand.skip_reason = "in disallowed_layer_names"
            elif any(n in config.disallowed_layer_names for n in others):
                cand.skip_reason = (f"weight tied to {[n for n in others if n in config.disallowed_layer_names][0]!r}, "
                                    "which is in disallowed_layer_names: pruning it would prune that layer too")
            elif parametrize.is_parametrized(module, pname) or (not isinstance(p, nn.Parameter) and p.grad_fn is not None):
                # weight_norm and other parametrizations recompute the weight from their own parameters at every
                # forward: masking the computed tensor left the layer dense, reported as pruned
                cand.skip_reason = (f"{pname} is computed from other parameters (weight_norm or a parametrization); "
                                    "remove it first (torch.nn.utils.parametrize.remove_parametrizations(module, "
                                    f"{pname!r})) to prune the layer")
            elif not p.requires_grad and p.grad_fn is None and not isinstance(p, nn.Parameter):
                cand.skip_reason = "not a parameter"
            elif id(p) in tied and config.allowed_layer_names is None:
                cand.skip_reason = (f"weight tied to {tied[id(p)]}: pruning it would zero that module's weights too; "
                                    f"name {mname!r} in allowed_layer_names to prune it anyway")
            elif p.dim() < 2:
                cand.skip_reason = f"{pname} has shape {tuple(p.shape)}: 2:4 needs a weight of 2 or more dims (out, in, ...)"
            elif isinstance(module, nn.modules.conv._ConvNd) and module.groups != 1:
                cand.skip_reason = f"grouped convolution (groups={module.groups}): no dense GEMM to sparsify"
            else:  # judged as the GEMM operand (out, in)
                cand.skip_reason = shape_rule(tuple(p.t().shape) if cand.transposed else tuple(p.shape))
            out.append(cand)
    return out
