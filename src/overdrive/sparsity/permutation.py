"""Channel permutation search (torch.fx): reorder input channels of sparse layers to raise the
magnitude 2:4 pruning keeps, and reorder their producers' outputs to match, so that the permutation
alone leaves the model's outputs unchanged.

A group is a producer (Linear or ungrouped Conv) whose output reaches only sparse-able consumers
of the same kind through channel-wise ops (activations, dropout, pooling and BatchNorm for convs).
Outputs that reach anything else (a residual add, a flatten, the model output) keep their order:
permuting them would change what those users see.
Layers whose weight is computed at every forward (weight_norm, spectral_norm, parametrizations) keep their order
too: their parameters, not the computed tensor, would have to be reordered.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive.sparsity.config import SparsityConfig
from overdrive.sparsity.masks import to_matrix

_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Hardswish,
                        nn.ELU, nn.Mish, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_CONV_CHANNELWISE = (nn.modules.batchnorm._BatchNorm, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
                     nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_ELEMENTWISE_FUNCS = {F.relu, torch.relu, F.gelu, F.silu, torch.tanh, torch.sigmoid, F.dropout, F.leaky_relu,
                      F.relu6, F.hardswish, F.elu, torch.nn.functional.mish}
_ELEMENTWISE_METHODS = {"relu", "sigmoid", "tanh", "relu_", "contiguous"}


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd) and not isinstance(module, nn.modules.conv._ConvTransposeNd) \
            and module.groups == 1:
        return "conv"
    return None


def group_score(cols: torch.Tensor) -> torch.Tensor:
    """Magnitude 2:4 keeps of (..., rows, 4) columns: the 2 largest |w| of each row, summed."""
    return cols.topk(2, dim=-1).values.sum(dim=(-1, -2))


# The search's budget is counted in work (weights scored), not seconds, so that the result depends on the
# weights alone: the same on every rank and every run, however loaded the machine. About what one CPU core
# scores in a second.
WORK_PER_SECOND = 2e8


def search_permutation(matrix: torch.Tensor, budget_s: float = 2.0) -> torch.Tensor:
    """A permutation of ``matrix``'s columns (rows, C) that raises the 2:4 kept magnitude.

    Greedy channel swaps between groups of 4: for each group, try every swap with every other
    group (16 per pair, vectorized) and take the best improving one; repeat until no swap helps
    or the budget is spent. The budget is ``budget_s * WORK_PER_SECOND`` weights scored, a count, not a
    clock: the result is deterministic (ties go to the lowest group and channel index). Never returns a
    permutation worse than the identity.
    """
    mag = matrix.detach().abs().float()
    rows, c = mag.shape
    g = c // 4
    perm = torch.arange(c)
    cur = mag.clone()
    scores = group_score(cur.reshape(rows, g, 4).permute(1, 0, 2))  # (g,)
    budget = budget_s * WORK_PER_SECOND
    per_group = 16 * g * rows * 4  # weights scored to try every swap of one group
    work = 0.0
    improved = True
    while improved and work < budget:
        improved = False
        for a in range(g):
            if work >= budget:
                break
            work += per_group
            ca = cur[:, 4 * a:4 * a + 4]  # (rows, 4)
            others = cur.reshape(rows, g, 4).permute(1, 0, 2)  # (g, rows, 4)
            # Swap channel i of group a with channel j of group b, for all b, i, j: (g, 4, 4) gains.
            best_gain, best = 0.0, None
            for i in range(4):
                for j in range(4):
                    new_a = ca.unsqueeze(0).expand(g, rows, 4).clone()
                    new_a[:, :, i] = others[:, :, j]
                    new_b = others.clone()
                    new_b[:, :, j] = ca[:, i].unsqueeze(0)
                    gain = group_score(new_a) + group_score(new_b) - scores[a] - scores
                    gain[a] = 0.0
                    val, b = gain.max(0)
                    if float(val) > best_gain + 1e-6 * float(scores[a]):
                        best_gain, best = float(val), (int(b), i, j)
            if best is not None:
                b, i, j = best
                ia, ib = 4 * a + i, 4 * b + j
                cur[:, [ia, ib]] = cur[:, [ib, ia]]
                perm[[ia, ib]] = perm[[ib, ia]]
                for k in (a, b):
                    scores[k] = group_score(cur[:, 4 * k:4 * k + 4])
                improved = True
    return perm


def _first_input(node: Any) -> Any:
    """The tensor an element-wise call acts on: its first argument, or ``input=`` (``F.gelu(input=h)`` has no
    positional arguments)."""
    return node.args[0] if node.args else node.kwargs.get("input")


def _users_closed(node: Any, modules: dict[str, nn.Module], kind: str, consumers: list[str], path: list[str]) -> bool:
    """True when every path from ``node`` ends in a consumer of ``kind`` through channel-wise ops."""
    for user in node.users:
        if user.op == "call_module":
            mod = modules[user.target]
            if _kind(mod) == kind:
                consumers.append(user.target)
                continue
            chan = isinstance(mod, _ELEMENTWISE_MODULES) or (kind == "conv" and isinstance(mod, _CONV_CHANNELWISE))
            if not chan:
                return False
            path.append(user.target)
        elif user.op == "call_function" and user.target in _ELEMENTWISE_FUNCS and _first_input(user) is node:
            pass
        elif user.op == "call_method" and user.target in _ELEMENTWISE_METHODS:
            pass
        else:
            return False
        if not _users_closed(user, modules, kind, consumers, path):
            return False
    return True


def find_groups(model: nn.Module) -> tuple[list[dict[str, Any]], list[str]]:
    """Producer -> consumers groups that can be permuted without changing the model's outputs."""
    import torch.fx

    notes: list[str] = []
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as exc:  # data-dependent control flow etc.
        return [], [f"torch.fx could not trace {type(model).__name__} ({type(exc).__name__}: {exc}); no permutation"]
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    # a parameter shared with another module (tied weights) or read directly in forward (get_attr)
    # would see the permutation too: groups touching one keep their order
    holders: dict[int, set[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for q in mod._parameters.values():
            if q is not None:
                holders.setdefault(id(q), set()).add(mname)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, torch.Tensor):
                holders.setdefault(id(obj), set()).add(f"<get_attr {n.target}>")

    def _shared(name: str) -> bool:
        return any(len(holders.get(id(q), ())) > 1 for q in model.get_submodule(name)._parameters.values() if q is not None)

    def _computed(name: str) -> bool:
        # weight_norm / spectral_norm (the hook versions and the parametrizations) recompute ``weight`` from their own
        # parameters at every forward: reordering the computed tensor does nothing, so a producer kept its channel
        # order while its consumers' columns were reordered, and the "output-preserving" permutation changed outputs
        mod = model.get_submodule(name)
        return any(getattr(mod, t, None) is not None and not isinstance(mod._parameters.get(t), nn.Parameter)
                   for t in ("weight", "bias"))

    groups = []
    for n in gm.graph.nodes:
        if n.op != "call_module" or _kind(modules[n.target]) is None:
            continue
        kind = _kind(modules[n.target])
        consumers: list[str] = []
        path: list[str] = []
        if not _users_closed(n, modules, kind, consumers, path) or not consumers:
            continue
        if any(calls[t] != 1 for t in [n.target, *consumers, *path]):
            notes.append(f"{n.target}: a module on its path is called more than once; not permuted")
            continue
        if any(_shared(t) for t in [n.target, *consumers, *path]):
            notes.append(f"{n.target}: a weight on its path is shared with another module or read directly; not permuted")
            continue
        computed = [t for t in [n.target, *consumers, *path] if _computed(t)]
        if computed:
            notes.append(f"{n.target}: {computed[0]} computes its weight from other parameters (weight_norm or a "
                         "parametrization); not permuted")
            continue
        groups.append({"producer": n.target, "consumers": sorted(set(consumers)), "channelwise": path})
    _ = operator  # (kept for readers: residual adds are operator.add nodes, which stop a group)
    return groups, notes


def apply_permutation(model: nn.Module, group: dict[str, Any], perm: torch.Tensor,
                      masters: dict[int, torch.Tensor] | None = None,
                      optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """Reorder the producer's output channels (weight rows, bias), BatchNorm stats/affine on the
    path, and the consumers' input channels, all by ``perm``. ``masters`` (id of a model parameter -> its
    fp32 master under amp O2) are reordered with their parameters, or the next step would copy them back; so is
    the state ``optimizers`` keep for each (Adam's moments, SGD's momentum): left in the old order, fine-tuning a
    trained model updated each channel with another channel's moments."""
    masters = masters or {}

    def states(x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for opt in optimizers:
            st = opt.state.get(x)
            if isinstance(st, dict):
                out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.shape == x.shape and v.dim() > 0]
        return out

    def rows(t: torch.Tensor) -> None:
        for x in (t, masters.get(id(t))):
            if x is not None:
                for y in (x, *states(x)):
                    y.copy_(y[p.to(y.device)])

    with torch.no_grad():
        prod = model.get_submodule(group["producer"])
        p = perm.to(prod.weight.device)
        rows(prod.weight)
        if prod.bias is not None:
            rows(prod.bias)
        for name in group["channelwise"]:
            mod = model.get_submodule(name)
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                for t in (mod.weight, mod.bias, mod.running_mean, mod.running_var):
                    if t is not None:
                        rows(t)
        for name in group["consumers"]:
            cons = model.get_submodule(name)
            for x in (cons.weight, masters.get(id(cons.weight))):
                if x is not None:
                    for y in (x, *states(x)):
                        y.copy_(y[:, p.to(y.device)])


def permute_for_sparsity(model: nn.Module, sparse_modules: list[nn.Module], config: SparsityConfig,
                         masters: dict[int, torch.Tensor] | None = None,
                         optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[str, Any]:
    """Search and apply input-channel permutations for the groups whose consumers include a sparse
    module; returns {"groups": n, "details": [...], "notes": [...]}."""
    groups, notes = find_groups(model)
    sparse_ids = {id(m) for m in sparse_modules}
    details = []
    for grp in groups:
        cons = [model.get_submodule(n) for n in grp["consumers"]]
        if not any(id(m) in sparse_ids for m in cons) or cons[0].weight.shape[1] % 4:
            continue
        mat = torch.cat([to_matrix(m.weight.detach()) for m in cons], dim=0)  # (sum rows, C)
        before = float(group_score(mat.abs().float().reshape(mat.shape[0], -1, 4).permute(1, 0, 2)).sum())
        perm = search_permutation(mat, config.permutation_budget_s)
        after = float(group_score(mat[:, perm].abs().float().reshape(mat.shape[0], -1, 4).permute(1, 0, 2)).sum())
        if after > before:
            apply_permutation(model, grp, perm, masters, optimizers)
            details.append({**grp, "kept_before": before, "kept_after": after})
    return {"groups": len(details), "details": details, "notes": notes}
