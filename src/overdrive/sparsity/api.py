"""The native verbs: ``handle = sparsify(model, SparsityConfig(...))`` prunes a model and returns the
:class:`~overdrive.sparsity.handle.SparseHandle` that owns its masks and hooks; :func:`from_pruned` and
:func:`load_pruned` give the handle of a model pruned before (a copy, a checkpoint).

No global state: every model gets its own handle, so several pruned models live in one process.
Masks are bool buffers on the pruned modules (``<param>_sparse_mask``, :mod:`overdrive.sparsity.pruned`),
so ``model.state_dict()`` carries them and checkpoint/resume keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity.config import SparsityConfig
from overdrive.sparsity.handle import SparseHandle
from overdrive.sparsity.layers import Candidate, find_candidates
# _LoadCheck and _CheckpointNames: a model pickled whole (torch.save(model)) names its hooks by this module
from overdrive.sparsity.pruned import (MASK_SUFFIX, PRUNED_SUFFIX, PrunedLayer, _CheckpointNames,  # noqa: F401
                                       _LoadCheck)

__all__ = ["sparsify", "from_pruned", "load_pruned", "SparseHandle", "PrunedLayer", "MASK_SUFFIX", "PRUNED_SUFFIX"]


def from_pruned(model: nn.Module, config: SparsityConfig | None = None) -> SparseHandle:
    """A handle over a model that already carries 2:4 mask buffers (a deepcopy of a pruned model,
    one loaded from a checkpoint saved with its masks), for report/attach/export.

    Example:
        >>> import copy
        >>> model = nn.Sequential(nn.Linear(32, 16)); _ = sparsify(model)
        >>> len(from_pruned(copy.deepcopy(model)).layers)
        1
    """
    config = config or SparsityConfig()
    layers = [_layer_of(c) for c in _every_candidate(model, config) if hasattr(c.module, c.param_name + MASK_SUFFIX)]
    if not layers:
        raise UsageError(f"{type(model).__name__} has no 2:4 mask buffers; prune it with sparsify() first")
    return SparseHandle(model, config, layers, [], {})


def load_pruned(model: nn.Module, state_dict: Mapping[str, Any], config: SparsityConfig | None = None) -> SparseHandle:
    """Load a pruned model's ``state_dict`` (its ``*_sparse_mask`` buffers included) into a fresh, unpruned model of
    the same architecture and return the handle that keeps the masks: a plain ``model.load_state_dict`` stops at
    the mask keys ("Unexpected key(s)"). The layers pruned are the ones the checkpoint has masks for; masks and
    weights are checked as at any load (2:4, weights zero where pruned). ``config``: the pruning's config (its
    ``custom_layers`` where custom layers were pruned, its mask calculator for later recomputes). A sparse-quantized
    checkpoint (masks and quantizers' amax) loads into a model quantized with the same config, without calibration:
    ``load_pruned(quant.quantize(fresh, config), state_dict)``.

    Example:
        >>> pruned = nn.Sequential(nn.Linear(32, 16)); _ = sparsify(pruned)
        >>> fresh = nn.Sequential(nn.Linear(32, 16))
        >>> handle = load_pruned(fresh, pruned.state_dict())
        >>> from overdrive.sparsity import is_2to4
        >>> is_2to4(fresh[0].weight), [ly.name for ly in handle.layers]
        (True, ['0.weight'])
    """
    if not isinstance(state_dict, Mapping):
        raise UsageError(f"load_pruned(state_dict=...) takes a mapping (model.state_dict() or torch.load of one), got "
                         f"{type(state_dict).__name__}")
    masked = {k[: -len(MASK_SUFFIX)] for k in state_dict if isinstance(k, str) and k.endswith(MASK_SUFFIX)}
    if not masked:
        raise UsageError("the state_dict holds no 2:4 masks (no '*_sparse_mask' keys): it is not from a pruned model; "
                         "load it with model.load_state_dict(state_dict)")
    if any(n.endswith(MASK_SUFFIX) for n, _ in model.named_buffers()):
        raise UsageError(f"{type(model).__name__} is pruned already (it has mask buffers): load the pruned "
                         "state_dict with model.load_state_dict(state_dict)")
    amax = [k for k in state_dict if isinstance(k, str) and "quantizer" in k.rpartition(".")[0].rpartition(".")[2]
            and not _has_submodule(model, k.rpartition(".")[0])]
    if amax:  # a sparse-quantized checkpoint into a float model: torch would only list them as unexpected keys
        raise UsageError(f"the state_dict holds quantizer state ({amax[0]}{' and more' if len(amax) > 1 else ''}) that "
                         f"{type(model).__name__} has no quantizer for: it is from a sparse-quantized model; quantize the "
                         "fresh model first with the same config, without calibrating (model = quant.quantize(model, "
                         "config); the amax come from the state_dict), then load_pruned(model, state_dict)")
    config = config or SparsityConfig()
    cands = {c.name: c for c in _every_candidate(model, config)}
    unknown = sorted(masked - set(cands))
    if unknown:
        raise UsageError(f"the state_dict has 2:4 masks for {unknown[:3]}, which {type(model).__name__} has no prunable "
                         "weight of that name for; give the model the checkpoint was saved from (for pruned custom "
                         "layers pass config=SparsityConfig(custom_layers={MyLayer: ['weight']}))")
    handle = SparseHandle(model, config, _install_masks([cands[name] for name in sorted(masked)]), [], {})
    try:
        model.load_state_dict(state_dict)
    except Exception:
        handle.remove()  # no mask buffers left behind: the error is torch's (missing keys, shapes) or the 2:4 check
        raise
    return handle


def sparsify(model: nn.Module, config: SparsityConfig | str | None = None, compute_masks: bool = True) -> SparseHandle:
    """Prune ``model`` to 2:4 in place (masks as buffers) and return the handle that keeps them. ``config`` is a
    :class:`SparsityConfig` or a preset's name (``"default"``, ``"transposable"``, ``"permuted"``).

    ``compute_masks=False`` installs all-ones masks (apex's init_model_for_pruning) for a later
    :meth:`SparseHandle.compute_masks`.

    Example:
        >>> model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        >>> handle = sparsify(model, SparsityConfig(disallowed_layer_names=("2",)))
        >>> [p["name"] for p in handle.report().pruned]
        ['0.weight']
    """
    if isinstance(config, str):  # a preset's name, as the CLI's --preset takes it
        from overdrive.sparsity.config import PRESETS

        if config not in PRESETS:
            raise UsageError(f"sparsify(config={config!r}): not a preset; use one of {sorted(PRESETS)} or a "
                             "SparsityConfig(...)")
        config = PRESETS[config]
    config = config or SparsityConfig()
    if not isinstance(config, SparsityConfig):
        raise UsageError(f"sparsify(config=...) takes a SparsityConfig or a preset name, got a "
                         f"{type(config).__name__}; build one with SparsityConfig(**your_dict)")
    if not isinstance(model, nn.Module):
        raise UsageError(f"sparsify expects a torch.nn.Module, got {type(model).__name__}")
    already = [n for n, _ in model.named_buffers() if n.endswith(MASK_SUFFIX)]
    if already:
        raise UsageError(f"model is already pruned (it has mask buffers such as {already[0]!r}); use its existing "
                         "handle, or handle.remove() before pruning again")
    cands = find_candidates(model, config)
    prunable = [c for c in cands if c.skip_reason is None]
    if not prunable:
        reasons = "; ".join(f"{c.name}: {c.skip_reason}" for c in cands[:5]) or "no Linear/Conv/MultiheadAttention layers"
        raise UsageError(f"no prunable layer in {type(model).__name__} for {config.layer_types} ({reasons})")
    handle = SparseHandle(model, config, _install_masks(prunable), [c for c in cands if c.skip_reason is not None], {})
    if compute_masks:
        handle.compute_masks()
    return handle


def _install_masks(cands: list[Candidate]) -> list[PrunedLayer]:
    """Register an all-ones mask buffer on each candidate's module (kept in the state_dict)."""
    layers = []
    for c in cands:
        w = getattr(c.module, c.param_name)
        c.module.register_buffer(c.param_name + MASK_SUFFIX, torch.ones_like(w, dtype=torch.bool), persistent=True)
        layers.append(_layer_of(c))
    return layers


def _layer_of(c: Candidate) -> PrunedLayer:
    return PrunedLayer(c.name, c.module, c.param_name, c.layer_type, getattr(c.module, c.param_name),
                       transposed=c.transposed)


def _every_candidate(model: nn.Module, config: SparsityConfig) -> list[Candidate]:
    """The model's prunable weights whatever the config's layer names (a pruned model's masks say which were)."""
    return find_candidates(model, config.replace(allowed_layer_names=None, disallowed_layer_names=()))


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
