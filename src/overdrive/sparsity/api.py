"""The native API: ``handle = sparsify(model, SparsityConfig(...))``; the handle owns masks and hooks.

No global state: every model gets its own handle, so several pruned models live in one process.
Masks are bool buffers on the pruned modules (``<param>_sparse_mask``), so ``model.state_dict()``
carries them and checkpoint/resume keeps them; amp never casts them (they are not floating).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity import masks as M
from overdrive.sparsity.config import SparsityConfig
from overdrive.sparsity.layers import Candidate, find_candidates, is_conv1d_gemm
from overdrive.sparsity.report import SparsityReport, gemm_macs

MASK_SUFFIX = "_sparse_mask"


@dataclass
class PrunedLayer:
    name: str
    module: nn.Module
    param_name: str
    layer_type: str
    original: torch.Tensor  # the Parameter at sparsify time (the fp32 master once amp O2 casts the model)
    # allow_recompute_mask: the values the current mask removed (zeros where it keeps, CPU), as in
    # apex ASP; recomputing or restoring adds them back, so trained unpruned weights keep their values
    pruned: torch.Tensor | None = None
    retained: float = 1.0
    retained_unpermuted: float | None = None
    magnitude: float = 0.0  # sum |w| of the dense weight the mask was computed from
    transposed: bool = False  # the weight is stored (in, out) (transformers' Conv1D): masks are chosen on its .t()

    def as_gemm(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the weight or its mask) as the GEMM operand (out, in, *k) that the 2:4 groups run along."""
        return t.t() if self.transposed else t

    @property
    def mask(self) -> torch.Tensor:
        return getattr(self.module, self.param_name + MASK_SUFFIX)

    @property
    def weight(self) -> torch.Tensor:
        """The weight the module computes with now (the half copy under amp O2)."""
        return getattr(self.module, self.param_name)


class SparseHandle:
    """Masks of one pruned model, the optimizer hooks that keep them, report and export.

    Example:
        >>> model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
        >>> handle = sparsify(model)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1); _ = handle.attach(opt)
        >>> M.is_2to4(model[0].weight)
        True
    """

    def __init__(self, model: nn.Module, config: SparsityConfig, layers: list[PrunedLayer], skipped: list[Candidate],
                 permutation: dict[str, Any]) -> None:
        self._model = weakref.ref(model)
        # The handle keeps its model alive; ASP's weak registry drops this strong reference so a
        # model deleted by the user frees its registry entry.
        self._strong: nn.Module | None = model
        self.config = config
        self.layers = layers
        self.skipped = skipped
        self.permutation = permutation
        self._hooks: list[Any] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        # every optimizer attached (ASP's registry drops its strong reference from _optimizers): the permutation
        # reorders their state too
        self._attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._permutation_pending = config.permutation
        # apex ASP's callable mask_calculator (weight -> mask); not part of the JSON config
        self.mask_fn: Any = None
        self._masters: dict[int, torch.Tensor] = {}  # amp O2 after sparsify: id(model param) -> fp32 master
        self._load_hooks = _add_load_checks(layers, self)

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise UsageError("the model of this sparsity handle no longer exists")
        return model

    # --- masks ------------------------------------------------------------------------------
    def compute_masks(self) -> None:
        """(Re)compute masks from the current weights and apply them.

        With ``allow_recompute_mask`` (apex's semantics) the values a mask removes are kept aside;
        a recompute first puts them back into the pruned positions, then chooses the new mask from
        those weights, so weights trained since the last mask keep their trained values. The first
        call runs the channel permutation search when the config asks for it."""
        if self._permutation_pending:
            self._permutation_pending = False
            self._permute()
        with torch.no_grad():
            for layer in self.layers:
                self._put_back_pruned(layer)
                w = layer.weight
                mask = self._mask_of(layer, w)
                layer.mask.copy_(mask)
                layer.retained = M.retained_magnitude(w, mask)
                layer.magnitude = float(w.detach().abs().float().sum())
                if self.config.allow_recompute_mask:
                    src = layer.original  # the fp32 master under amp O2: the most precise copy
                    layer.pruned = (src.detach() * ~mask.to(src.device)).to("cpu", copy=True)
        self.apply_masks()

    def _mask_of(self, layer: PrunedLayer, w: torch.Tensor) -> torch.Tensor:
        """The mask of ``w`` in its stored layout, chosen on its GEMM view (out, in, *k)."""
        g = layer.as_gemm(w)
        if self.mask_fn is None:
            return layer.as_gemm(M.compute_mask(g, self.config.mask_calculator))
        mask = self.mask_fn(g.detach())
        if not isinstance(mask, torch.Tensor) or mask.shape != g.shape:
            raise UsageError(f"mask_calculator returned {type(mask).__name__} of shape "
                             f"{tuple(getattr(mask, 'shape', ()))} for {layer.name} {tuple(g.shape)}; it must return a "
                             "tensor of the weight's shape (1/True keeps, 0/False prunes)")
        if not M.is_2to4(mask.bool()):
            # accepted here, its checkpoint was refused at load ("not a 2:4 pattern ... corrupt") after the fine-tuning
            raise UsageError(f"mask_calculator's mask for {layer.name} {tuple(g.shape)} keeps more than 2 of some group "
                             "of 4 along the input dimension; overdrive.sparsity keeps 2:4 patterns only (what sparse "
                             "tensor cores run): keep at most 2 of every 4 consecutive input weights")
        return layer.as_gemm(mask.to(device=layer.mask.device).bool())

    def use_masters(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Under amp O2, point each pruned layer at the fp32 master of its half weight (``(half, master)``
        pairs, :meth:`overdrive.amp.MixedPrecision.master_pairs`), so that masks reach what the optimizer
        steps. Pruning after O2 initialize then works as pruning before it."""
        master_of = {id(h): m for h, m in pairs}
        if not any(id(layer.weight) in master_of for layer in self.layers):
            return  # another model's run
        self._masters.update(master_of)
        for layer in self.layers:
            if id(layer.weight) in master_of:
                layer.original = master_of[id(layer.weight)]

    def _put_back_pruned(self, layer: PrunedLayer) -> None:
        """Add the values the current mask removed back into the model weight and its master."""
        if layer.pruned is None or bool(layer.mask.all()):
            return
        removed = ~layer.mask
        for t in {id(x): x for x in (layer.weight, layer.original)}.values():
            # the pruned positions hold zeros (masks are applied after every step): add, don't copy,
            # so the kept positions keep their trained values
            t.add_(layer.pruned.to(t.device, t.dtype) * removed.to(t.device))

    def _permute(self) -> None:
        from overdrive.sparsity.permutation import permute_for_sparsity

        for layer in self.layers:
            w = layer.as_gemm(layer.weight)
            layer.retained_unpermuted = M.retained_magnitude(w, M.compute_mask(w, self.config.mask_calculator))
        # a Conv1D (weight stored (in, out)) is not permuted: its masks are chosen as they are
        self.permutation = permute_for_sparsity(
            self.model, [layer.module for layer in self.layers if layer.param_name == "weight" and not layer.transposed],
            self.config, self._masters, list(self._attached))

    def apply_masks(self) -> None:
        """Zero pruned weights in the model and in the optimizer's copies (fp32 masters under amp O2)."""
        with torch.no_grad():
            for layer in self.layers:
                mask = layer.mask
                if layer.weight.layout != torch.strided or _is_semi_structured(layer.weight):
                    continue  # exported to cuSPARSELt: inference only, already 2:4 by construction
                for t in {id(x): x for x in (layer.weight, layer.original)}.values():
                    t.mul_(mask.to(t.device))

    def mask_grads(self) -> None:
        """Zero the gradients of pruned weights (the model's and the fp32 masters' under amp O2).
        masked_fill, not a multiply: an inf gradient in a pruned position must not become NaN."""
        with torch.no_grad():
            for layer in self.layers:
                mask = layer.mask
                for t in {id(x): x for x in (layer.weight, layer.original)}.values():
                    if t.grad is not None and t.grad.layout == torch.strided and t.grad.shape == mask.shape:
                        t.grad.masked_fill_(~mask.to(t.grad.device), 0)

    def restore_dense(self) -> None:
        """Put back the weight values the masks removed and reset the masks to all ones (needs
        ``allow_recompute_mask=True``); weights trained since pruning keep their trained values."""
        if not self.config.allow_recompute_mask:
            raise UsageError("no pruned weights were kept (allow_recompute_mask=False); sparsify with "
                             "SparsityConfig(allow_recompute_mask=True) to restore them")
        lost = [layer.name for layer in self.layers if layer.pruned is None and not bool(layer.mask.all())]
        if lost:
            raise UsageError(f"the pruned values of {lost[:3]} are not held by this handle (their masks came from a "
                             "checkpoint, not from this handle's compute_masks()); reload the dense checkpoint to get "
                             "the dense weights back")
        with torch.no_grad():
            for layer in self.layers:
                self._put_back_pruned(layer)
                layer.pruned = None
                layer.mask.fill_(True)

    def masks(self) -> dict[str, torch.Tensor]:
        return {layer.name: layer.mask for layer in self.layers}

    def verify(self) -> None:
        """Raise when a mask is not 2:4, or a weight is nonzero where its mask prunes it; for layers
        quantized by overdrive.quant, also when the calibrated weight quantizer's (fake-)quantized
        weight is nonzero where the mask prunes it."""
        if self._stale():
            self.rebind(self.model)
        for layer in self.layers:
            _check_layer(layer)
            _check_quantized(layer)

    def _stale(self) -> bool:
        """True when a module swap in the model (quant.quantize) replaced a pruned layer object."""
        model = self.model
        for layer in self.layers:
            owner = layer.name.rsplit(".", 1)[0] if "." in layer.name else ""
            try:
                if model.get_submodule(owner) is not layer.module:
                    return True
            except AttributeError:
                return False  # rebind would fail too; the checks below report on the layers held
        return False

    def rebind(self, model: nn.Module) -> SparseHandle:
        """Point the handle at ``model`` after a module swap replaced pruned layers (``quant.quantize``
        swaps Linear/Conv for QuantLinear/QuantConv and may return a new root); layers are found by name.

        The swapped layers must carry the same weights and mask buffers; the optimizer hooks already
        attached keep working (they mask the same Parameter objects), the load-time check moves to
        the new modules.

        Example:
            >>> model = nn.Sequential(nn.Linear(32, 16)); handle = sparsify(model)
            >>> new = nn.Sequential(model[0]); handle.rebind(new).model is new
            True
        """
        found = []
        for layer in self.layers:
            owner = layer.name.rsplit(".", 1)[0] if "." in layer.name else ""
            try:
                module = model.get_submodule(owner)
            except AttributeError as exc:
                raise UsageError(f"{type(model).__name__} has no layer {owner!r} that this sparsity handle pruned; "
                                 "rebind only a model derived from the pruned one (same layer names)") from exc
            if not hasattr(module, layer.param_name + MASK_SUFFIX):
                raise UsageError(f"layer {owner!r} of {type(model).__name__} has no 2:4 mask buffer "
                                 f"{layer.param_name + MASK_SUFFIX!r}; the swap must keep the pruned layer's buffers")
            found.append(module)
        old_weights = [layer.weight for layer in self.layers]
        # the load-time check: drop the hooks on the old modules (a swap may share their hook dicts
        # with the new ones) and register them on the new modules
        for h in self._load_hooks:
            h.remove()
        for layer, module, old in zip(self.layers, found, old_weights):
            layer.module = module
            if layer.original is old:  # no amp master: the original is the module's weight itself
                layer.original = layer.weight
        self._load_hooks = _add_load_checks(self.layers, self)
        self._model = weakref.ref(model)
        if self._strong is not None:
            self._strong = model
        _check_shapes(self.layers)
        return self

    # --- training ---------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> SparseHandle:
        """Keep masks through ``optimizer.step()`` (any optimizer: foreach, fused, amp masters): a step
        pre-hook zeroes the gradients of pruned weights, as apex ASP does (so optimizers that mix
        gradients across elements, e.g. Adafactor, and momentum buffers see no pruned gradient), and a
        post-hook re-applies the masks. Sparsify before ``amp.prepare``: the hooks then mask the fp32
        masters and the half model weights alike, whichever hook runs first."""
        held = {id(q) for g in optimizer.param_groups for q in g["params"]}
        # frozen pruned layers (requires_grad=False) are not the optimizer's to hold; they need no hook
        trainable = [layer for layer in self.layers if layer.original.requires_grad or layer.weight.requires_grad]
        missing = [layer.name for layer in trainable if id(layer.original) not in held and id(layer.weight) not in held]
        if trainable and len(missing) == len(trainable):
            raise UsageError(
                f"the optimizer holds none of the pruned weights ({missing[:3]}...): pass the optimizer built on this "
                "model's parameters; with overdrive.amp O2/apex O2, call sparsify/ASP before amp.prepare/initialize"
            )
        stale = self._permuted_with_state(optimizer)
        if stale:
            # its moments are in the channel order from before the permutation: fine-tuning would update each channel
            # with another's (attached before compute_masks, the permutation reorders them too)
            raise UsageError(
                f"this optimizer holds state (momentum, Adam moments) for {stale[:3]}, whose channels the sparsity "
                "permutation reordered after that state was made; attach it before the masks are computed "
                "(sparsify(model, compute_masks=False); handle.attach(optimizer); handle.compute_masks(), which is "
                "what ASP.prune_trained_model does), build a new optimizer, or sparsify with SparsityConfig(permutation=False)")
        self._hooks.append(optimizer.register_step_pre_hook(lambda _opt, _a, _k: self.mask_grads()))
        self._hooks.append(optimizer.register_step_post_hook(lambda _opt, _a, _k: self.apply_masks()))
        self._optimizers.append(optimizer)
        self._attached.add(optimizer)
        self.apply_masks()
        return self

    def _permuted_with_state(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Names of parameters the permutation reordered for which ``optimizer`` already holds tensor state."""
        if not self.permutation or not self.permutation.get("groups"):
            return []
        names = []
        for d in self.permutation["details"]:
            for mname in (d["producer"], *d["channelwise"], *d["consumers"]):
                mod = self.model.get_submodule(mname)
                for pname, q in mod.named_parameters(recurse=False):
                    if mname in d["consumers"] and pname != "weight":
                        continue  # a consumer's input channels: its weight's columns only
                    for x in (q, self._masters.get(id(q))):
                        st = optimizer.state.get(x) if x is not None else None
                        if isinstance(st, dict) and any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in st.values()):
                            names.append(f"{mname}.{pname}")
        return sorted(set(names))

    def remove(self) -> None:
        """Drop hooks and mask buffers; the weights stay pruned."""
        for h in self._hooks + self._load_hooks:
            h.remove()
        self._hooks.clear()
        self._load_hooks.clear()
        for layer in self.layers:
            delattr(layer.module, layer.param_name + MASK_SUFFIX)

    # --- reporting and export ---------------------------------------------------------------
    def report(self, example_inputs: tuple[Any, ...] | None = None) -> SparsityReport:
        """Pruned/skipped layers, weight and (with ``example_inputs``) FLOP fractions pruned."""
        rep = SparsityReport(self.config.pattern, self.config.mask_calculator, permutation=self.permutation)
        total_w = sum(q.numel() for q in self.model.parameters())
        zeros = 0
        kept_mag = all_mag = 0.0
        for layer in self.layers:
            w = layer.weight.detach()
            zeros += int((~layer.mask).sum())
            rep.pruned.append({"name": layer.name, "type": layer.layer_type, "shape": list(w.shape),
                               "retained_magnitude": layer.retained})
            kept_mag += layer.retained * layer.magnitude
            all_mag += layer.magnitude
        for c in self.skipped:
            rep.skipped.append({"name": c.name, "type": c.layer_type, "shape": list(getattr(c.module, c.param_name).shape),
                                "reason": c.skip_reason})
        rep.weight_fraction_pruned = zeros / max(total_w, 1)
        rep.retained_magnitude = kept_mag / all_mag if all_mag else 1.0
        if any(layer.retained_unpermuted is not None for layer in self.layers):
            num = sum((layer.retained_unpermuted if layer.retained_unpermuted is not None else layer.retained)
                      * layer.magnitude for layer in self.layers)
            rep.retained_magnitude_unpermuted = num / all_mag if all_mag else None
        if example_inputs is not None:
            macs = gemm_macs(self.model, tuple(example_inputs))
            total = sum(macs.values())
            pruned = sum(macs.get(id(layer.weight), 0) for layer in self.layers) / 2
            rep.flop_fraction_pruned = pruned / total if total else 0.0
        return rep

    def export(self, **kwargs: Any) -> Any:
        """Swap pruned Linear weights to cuSPARSELt 2:4 tensors where measured faster; see
        :func:`overdrive.sparsity.kernels.to_semi_structured` for the arguments."""
        from overdrive.sparsity.kernels import to_semi_structured

        return to_semi_structured(self.model, self, **kwargs)



class _LoadCheck:
    """The load-state-dict post-hook on a pruned module: the loaded masks are 2:4 and the loaded weights
    zero where they prune. It holds names only, not the handle (whose weak reference to the model cannot
    be pickled), so ``torch.save(model)`` works on a pruned model and the loaded model keeps the check."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names  # param name on the module -> the layer's name in the model

    def __call__(self, module: nn.Module, _incompatible: Any) -> None:
        for param_name, name in self.names.items():
            if hasattr(module, param_name + MASK_SUFFIX):
                _check_layer(PrunedLayer(name, module, param_name, "", getattr(module, param_name),
                                         transposed=is_conv1d_gemm(module)))


PRUNED_SUFFIX = "_sparse_pruned"  # allow_recompute_mask: the pruned values, in the checkpoint (apex: __w_mma_pruned_p)


class _CheckpointNames:
    """A pruned module's state-dict hooks: saves the values its masks removed (``<param>_sparse_pruned``,
    with ``allow_recompute_mask``) so that ``restore_pruned_weights()`` works after a resume, and reads
    checkpoints written by apex ASP, whose buffers are ``__<param>_mma_mask`` (a float mask) and
    ``__<param>_mma_pruned_p``. Holds the handle weakly; a pickled model's hooks hold none."""

    def __init__(self, handle: SparseHandle, param_names: tuple[str, ...]) -> None:
        self.handle = weakref.ref(handle)
        self.param_names = param_names

    def __getstate__(self) -> dict[str, Any]:
        return {"param_names": self.param_names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.param_names = state["param_names"]
        self.handle = lambda: None  # type: ignore[assignment]

    def _layers(self, module: nn.Module) -> dict[str, PrunedLayer]:
        handle = self.handle()
        return {} if handle is None else {ly.param_name: ly for ly in handle.layers if ly.module is module}

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        """The state-dict post-hook (a callable object: torch marks the hook with an attribute)."""
        for name, layer in self._layers(module).items():
            if layer.pruned is not None:
                state_dict[prefix + name + PRUNED_SUFFIX] = layer.pruned.clone()

    def load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        layers = self._layers(module)
        for name in self.param_names:
            apex_mask = state_dict.pop(f"{prefix}__{name}_mma_mask", None)
            if apex_mask is not None:
                state_dict.setdefault(prefix + name + MASK_SUFFIX, apex_mask.bool())
            pruned = state_dict.pop(prefix + name + PRUNED_SUFFIX, None)
            apex_pruned = state_dict.pop(f"{prefix}__{name}_mma_pruned_p", None)
            pruned = pruned if pruned is not None else apex_pruned
            layer, handle = layers.get(name), self.handle()
            if layer is not None and handle is not None and handle.config.allow_recompute_mask and pruned is not None:
                layer.pruned = pruned.detach().to("cpu", copy=True)


def _add_load_checks(layers: list[PrunedLayer], handle: SparseHandle) -> list[Any]:
    by_module: dict[int, tuple[nn.Module, dict[str, str]]] = {}
    for layer in layers:
        by_module.setdefault(id(layer.module), (layer.module, {}))[1][layer.param_name] = layer.name
    hooks = []
    for m, names in by_module.values():
        names_hook = _CheckpointNames(handle, tuple(names))
        hooks += [m.register_load_state_dict_pre_hook(names_hook.load),
                  m.register_state_dict_post_hook(names_hook),
                  m.register_load_state_dict_post_hook(_LoadCheck(names))]
    return hooks


def _is_semi_structured(t: torch.Tensor) -> bool:
    return isinstance(t, torch.sparse.SparseSemiStructuredTensor)


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
    layers = []
    cands = find_candidates(model, config.replace(allowed_layer_names=None, disallowed_layer_names=()))
    for c in cands:
        if hasattr(c.module, c.param_name + MASK_SUFFIX):
            layers.append(PrunedLayer(c.name, c.module, c.param_name, c.layer_type, getattr(c.module, c.param_name),
                                      transposed=c.transposed))
    if not layers:
        raise UsageError(f"{type(model).__name__} has no 2:4 mask buffers; prune it with sparsify() first")
    return SparseHandle(model, config, layers, [], {})


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


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
        >>> M.is_2to4(fresh[0].weight), [ly.name for ly in handle.layers]
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
    cands = {c.name: c for c in find_candidates(model, config.replace(allowed_layer_names=None, disallowed_layer_names=()))}
    unknown = sorted(masked - set(cands))
    if unknown:
        raise UsageError(f"the state_dict has 2:4 masks for {unknown[:3]}, which {type(model).__name__} has no prunable "
                         "weight of that name for; give the model the checkpoint was saved from (for pruned custom "
                         "layers pass config=SparsityConfig(custom_layers={MyLayer: ['weight']}))")
    layers = []
    for name in sorted(masked):
        c = cands[name]
        w = getattr(c.module, c.param_name)
        c.module.register_buffer(c.param_name + MASK_SUFFIX, torch.ones_like(w, dtype=torch.bool), persistent=True)
        layers.append(PrunedLayer(c.name, c.module, c.param_name, c.layer_type, w, transposed=c.transposed))
    handle = SparseHandle(model, config, layers, [], {})
    try:
        model.load_state_dict(state_dict)
    except Exception:
        handle.remove()  # no mask buffers left behind: the error is torch's (missing keys, shapes) or the 2:4 check
        raise
    return handle


def _check_shapes(layers: list[PrunedLayer]) -> None:
    for layer in layers:
        if layer.mask.shape != layer.weight.shape:
            raise UsageError(f"mask of {layer.name} has shape {tuple(layer.mask.shape)} but the weight is "
                             f"{tuple(layer.weight.shape)}; the rebound model does not match the pruned one")


def _check_quantized(layer: PrunedLayer) -> None:
    """The weight a calibrated overdrive.quant weight quantizer produces must keep the pruned zeros."""
    q = getattr(layer.module, "weight_quantizer", None) if layer.param_name == "weight" else None
    if q is None or not q.enabled or q.calibrating or not q.is_calibrated:
        return
    with torch.no_grad():
        wq = q(layer.weight.detach())
    if bool((wq[~layer.mask.to(wq.device)] != 0).any()):
        raise UsageError(f"the quantized weight of {layer.name} is not 2:4 where its mask prunes it; quantize with a "
                         "symmetric quantizer (zero point 0) so that pruned zeros stay zero")


def _check_layer(layer: PrunedLayer) -> None:
    mask, w = layer.mask, layer.weight
    if mask.shape != w.shape:
        raise UsageError(f"mask of {layer.name} has shape {tuple(mask.shape)} but the weight is {tuple(w.shape)}; "
                         "load a checkpoint saved from this pruned model")
    if not bool(mask.all()) and not M.is_2to4(layer.as_gemm(mask)):
        raise UsageError(f"mask of {layer.name} is not a 2:4 pattern (more than 2 kept in a group of 4); "
                         "the checkpoint is corrupt or from another pattern")
    if bool((w.detach()[~mask.to(w.device)] != 0).any()):
        raise UsageError(f"weights of {layer.name} are nonzero where its mask prunes them: the loaded weights do not "
                         "match the loaded masks; load weights and masks from the same pruned checkpoint")


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
    layers = []
    for c in prunable:
        w = getattr(c.module, c.param_name)
        c.module.register_buffer(c.param_name + MASK_SUFFIX, torch.ones_like(w, dtype=torch.bool), persistent=True)
        layers.append(PrunedLayer(c.name, c.module, c.param_name, c.layer_type, w, transposed=c.transposed))
    handle = SparseHandle(model, config, layers, [c for c in cands if c.skip_reason is not None], {})
    if compute_masks:
        handle.compute_masks()
    return handle
