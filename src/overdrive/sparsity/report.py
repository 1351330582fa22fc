"""What :meth:`SparseHandle.report` returns: pruned and skipped layers, weights and FLOPs pruned."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive.sparsity.layers import is_conv1d_gemm

if TYPE_CHECKING:
    from overdrive._utils.table import Table



@dataclass
class SparsityReport:
    """Pruned layers (name, shape, retained |w|), skipped layers with reasons, and totals.

    ``weight_fraction_pruned`` counts zeros introduced over all model parameters;
    ``flop_fraction_pruned`` (when example inputs were given) counts halved GEMM MACs over the MACs
    of every Linear / Conv / MultiheadAttention projection (attention's score matmuls excluded).
    """

    pattern: str
    mask_calculator: str
    pruned: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    weight_fraction_pruned: float = 0.0
    flop_fraction_pruned: float | None = None
    retained_magnitude: float = 1.0
    retained_magnitude_unpermuted: float | None = None
    permutation: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tables(self) -> list[Table]:
        from overdrive._utils.table import Table

        t = Table(f"2:4 sparsity ({self.mask_calculator})", ["layer", "shape", "status", "retained |w|"])
        for p in self.pruned:
            t.rows.append([p["name"], "x".join(map(str, p["shape"])), "pruned 2:4", p["retained_magnitude"]])
        for s in self.skipped:
            t.rows.append([s["name"], "x".join(map(str, s["shape"])), f"dense: {s['reason']}", None])
        t.notes.append(f"weights pruned: {self.weight_fraction_pruned:.1%} of all parameters")
        if self.flop_fraction_pruned is not None:
            t.notes.append(f"GEMM FLOPs pruned: {self.flop_fraction_pruned:.1%} (Linear/Conv/MHA projections)")
        t.notes.append(f"retained magnitude over pruned layers: {self.retained_magnitude:.4f}")
        if self.retained_magnitude_unpermuted is not None:
            t.notes.append(
                f"without channel permutation it would be {self.retained_magnitude_unpermuted:.4f} "
                f"({self.permutation.get('groups', 0)} channel group(s) permuted)"
            )
        for note in self.permutation.get("notes", []):
            t.notes.append(f"permutation: {note}")
        return [t]

    def __str__(self) -> str:
        return "".join(t.to_markdown() for t in self.tables())


def gemm_macs(model: nn.Module, example_inputs: tuple[Any, ...]) -> dict[int, int]:
    """MACs per weight (keyed by id of the weight parameter) for one forward on ``example_inputs``."""
    macs: dict[int, int] = {}
    hooks = []

    def linear_like(module: nn.Module, _args: Any, out: Any) -> None:
        w = module.weight
        positions = out.numel() // out.shape[-1] if isinstance(module, nn.Linear) else out.numel() // out.shape[1]
        if not isinstance(module, nn.Linear) and out.dim() == w.dim() - 1:  # unbatched conv input
            positions = out.numel() // out.shape[0]
        macs[id(w)] = macs.get(id(w), 0) + positions * w.numel()

    def mha(module: nn.MultiheadAttention, args: Any, _out: Any) -> None:
        q, k, v = args[0], args[1], args[2]
        e = module.embed_dim
        if module.in_proj_weight is not None:
            w = module.in_proj_weight
            macs[id(w)] = macs.get(id(w), 0) + (q.numel() + k.numel() + v.numel()) // e * e * e
        else:
            for x, w in ((q, module.q_proj_weight), (k, module.k_proj_weight), (v, module.v_proj_weight)):
                macs[id(w)] = macs.get(id(w), 0) + x.numel() // x.shape[-1] * w.numel()

    def conv1d_gemm(module: nn.Module, _args: Any, out: Any) -> None:  # transformers' Conv1D: x @ W (in, out)
        w = module.weight
        macs[id(w)] = macs.get(id(w), 0) + out.numel() // out.shape[-1] * w.numel()

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)):
            hooks.append(m.register_forward_hook(linear_like))
        elif is_conv1d_gemm(m):
            hooks.append(m.register_forward_hook(conv1d_gemm))
        elif isinstance(m, nn.MultiheadAttention):
            hooks.append(m.register_forward_hook(mha))
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return macs
