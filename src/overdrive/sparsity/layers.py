"""Which weights of a model can be pruned to 2:4, and why others are skipped.

The rule (cuSPARSELt / sparse tensor core GEMM constraints, as apex ASP applies them): a weight
viewed as a GEMM operand (out, in) is pruned when ``out % 8 == 0`` and ``in % 16 == 0`` (``in`` is
input channels for convolutions, whose groups of 4 run along them), and convolutions are not
grouped (a grouped conv is a batch of small GEMMs whose reduction dimension is ``in / groups``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from overdrive.sparsity.config import SparsityConfig

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


def _kind(module: nn.Module, wanted: tuple[str, ...]) -> str | None:
    for key in wanted:
        if isinstance(module, _TYPES[key]):  # subclasses count (apex matched exact types only)
            return key
    return None


def shape_rule(shape: tuple[int, ...]) -> str | None:
    """Why a weight of ``shape`` cannot use sparse kernels, or None when it can."""
    out, inp = shape[0], shape[1]
    if out % OUT_MULTIPLE or inp % IN_MULTIPLE:
        return f"shape {tuple(shape)}: sparse GEMMs need out % {OUT_MULTIPLE} == 0 and in % {IN_MULTIPLE} == 0"
    return None


def find_candidates(model: nn.Module, config: SparsityConfig) -> list[Candidate]:
    """Every weight of the configured layer types, with ``skip_reason`` set where it stays dense."""
    out: list[Candidate] = []
    seen: set[int] = set()
    for mname, module in model.named_modules():
        kind = _kind(module, config.layer_types)
        if kind is None:
            continue
        if kind == "MultiheadAttention":
            # out_proj is a Linear subclass and is found as its own module.
            names = ["in_proj_weight"] if module.in_proj_weight is not None else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
        else:
            names = ["weight"]
        for pname in names:
            p = getattr(module, pname, None)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            cand = Candidate(full, mname, module, pname, kind)
            if config.allowed_layer_names is not None and mname not in config.allowed_layer_names:
                cand.skip_reason = "not in allowed_layer_names"
            elif mname in config.disallowed_layer_names:
                cand.skip_reason = "in disallowed_layer_names"
            elif not p.requires_grad and p.grad_fn is None and not isinstance(p, nn.Parameter):
                cand.skip_reason = "not a parameter"
            elif isinstance(module, nn.modules.conv._ConvNd) and module.groups != 1:
                cand.skip_reason = f"grouped convolution (groups={module.groups}): no dense GEMM to sparsify"
            else:
                cand.skip_reason = shape_rule(tuple(p.shape))
            out.append(cand)
    return out
