"""The handle of one pruned model: its masks, the optimizer hooks that keep them, report and export.

:func:`overdrive.sparsity.sparsify` returns it. No global state: every model gets its own handle, so
several pruned models live in one process.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity import masks as M
from overdrive.sparsity.config import SparsityConfig
from overdrive.sparsity.layers import Candidate
from overdrive.sparsity.pruned import (MASK_SUFFIX, PrunedLayer, add_checkpoint_hooks, check_layer, check_quantized,
                                       check_shapes)
from overdrive.sparsity.report import SparsityReport, gemm_macs


class SparseHandle:
    """Masks of one pruned model, the optimizer hooks that keep them, report and export.

    Example:
        >>> from overdrive.sparsity import sparsify
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
        self._load_hooks = add_checkpoint_hooks(layers, self)

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
        call runs the channel permutation search when the config asks for it, unless the masks already
        prune (a pruned checkpoint loaded): its channels then keep their order."""
        if self._permutation_pending:
            self._permutation_pending = False
            if any(not bool(layer.mask.all()) for layer in self.layers):
                # masks already prune (loaded from a pruned checkpoint, or an adopted pruned copy): a permutation now
                # moved the weights' columns but not the masks nor the values kept aside, so the recompute put those
                # values back in the wrong places and pruned trained weights
                self.permutation = {"groups": 0, "details": [], "notes": [
                    "the model was already pruned when its masks were first computed here: channels keep their order "
                    "(a permutation is searched before the first masks only)"]}
            else:
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
        for t in layer.copies():
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
        """Zero pruned weights in the model and in the optimizer's copies (fp32 masters under amp O2).
        masked_fill, not a multiply: a pruned position holding NaN must become 0, and it does hold NaN after an
        Adam step of a half-precision weight (its gradient is zeroed, so its moments are 0, and Adam's eps of 1e-8
        underflows to 0 in fp16: 0 / 0); ``NaN * 0`` kept it there and the next forward was NaN everywhere."""
        with torch.no_grad():
            for layer in self.layers:
                mask = layer.mask
                if layer.weight.layout != torch.strided or _is_semi_structured(layer.weight):
                    continue  # exported to cuSPARSELt: inference only, already 2:4 by construction
                for t in layer.copies():
                    t.masked_fill_(~mask.to(t.device), 0)

    def mask_grads(self) -> None:
        """Zero the gradients of pruned weights (the model's and the fp32 masters' under amp O2).
        masked_fill, not a multiply: an inf gradient in a pruned position must not become NaN."""
        with torch.no_grad():
            for layer in self.layers:
                mask = layer.mask
                for t in layer.copies():
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
            check_layer(layer)
            check_quantized(layer)

    def _stale(self) -> bool:
        """True when a module swap in the model (quant.quantize) replaced a pruned layer object."""
        model = self.model
        for layer in self.layers:
            try:
                if model.get_submodule(layer.module_name) is not layer.module:
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
            >>> from overdrive.sparsity import sparsify
            >>> model = nn.Sequential(nn.Linear(32, 16)); handle = sparsify(model)
            >>> new = nn.Sequential(model[0]); handle.rebind(new).model is new
            True
        """
        found = []
        for layer in self.layers:
            owner = layer.module_name
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
        self._load_hooks = add_checkpoint_hooks(self.layers, self)
        self._model = weakref.ref(model)
        if self._strong is not None:
            self._strong = model
        check_shapes(self.layers)
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


def _is_semi_structured(t: torch.Tensor) -> bool:
    return isinstance(t, torch.sparse.SparseSemiStructuredTensor)
