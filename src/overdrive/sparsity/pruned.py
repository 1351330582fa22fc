"""A pruned layer: its mask buffer, the checks that its weights keep the mask, and the state-dict
hooks that carry masks through checkpoints (apex ASP's buffer names included).

A mask is a bool buffer ``<param>_sparse_mask`` on the pruned module, so ``model.state_dict()``
carries it and checkpoint/resume keeps it; amp never casts it (it is not floating).

Example:
    >>> from torch import nn
    >>> lin = nn.Linear(32, 16)
    >>> lin.register_buffer("weight" + MASK_SUFFIX, torch.ones_like(lin.weight, dtype=torch.bool))
    >>> layer = PrunedLayer("weight", lin, "weight", "Linear", lin.weight); check_layer(layer)
    >>> bool(layer.mask.all()), layer.module_name
    (True, '')
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity import masks as M
from overdrive.sparsity.layers import is_conv1d_gemm

if TYPE_CHECKING:
    from overdrive.sparsity.handle import SparseHandle

MASK_SUFFIX = "_sparse_mask"
PRUNED_SUFFIX = "_sparse_pruned"  # allow_recompute_mask: the pruned values, in the checkpoint (apex: __w_mma_pruned_p)


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

    @property
    def module_name(self) -> str:
        """The name of the module in the model ("" for the root)."""
        return self.name.rsplit(".", 1)[0] if "." in self.name else ""

    def copies(self) -> list[torch.Tensor]:
        """The tensors a mask applies to: the model's weight and, under amp O2, the fp32 master behind it."""
        return list({id(x): x for x in (self.weight, self.original)}.values())


def check_shapes(layers: list[PrunedLayer]) -> None:
    for layer in layers:
        if layer.mask.shape != layer.weight.shape:
            raise UsageError(f"mask of {layer.name} has shape {tuple(layer.mask.shape)} but the weight is "
                             f"{tuple(layer.weight.shape)}; the rebound model does not match the pruned one")


def check_quantized(layer: PrunedLayer) -> None:
    """The weight a calibrated overdrive.quant weight quantizer produces must keep the pruned zeros."""
    q = getattr(layer.module, "weight_quantizer", None) if layer.param_name == "weight" else None
    if q is None or not q.enabled or q.calibrating or not q.is_calibrated:
        return
    with torch.no_grad():
        wq = q(layer.weight.detach())
    if bool((wq[~layer.mask.to(wq.device)] != 0).any()):
        raise UsageError(f"the quantized weight of {layer.name} is not 2:4 where its mask prunes it; quantize with a "
                         "symmetric quantizer (zero point 0) so that pruned zeros stay zero")


def check_layer(layer: PrunedLayer) -> None:
    """Raise when the mask is not 2:4 (or not the weight's shape), or the weight is nonzero where it prunes."""
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


# --- state-dict hooks ---------------------------------------------------------------------------


class _LoadCheck:
    """The load-state-dict post-hook on a pruned module: the loaded masks are 2:4 and the loaded weights
    zero where they prune. It holds names only, not the handle (whose weak reference to the model cannot
    be pickled), so ``torch.save(model)`` works on a pruned model and the loaded model keeps the check."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names  # param name on the module -> the layer's name in the model

    def __call__(self, module: nn.Module, _incompatible: Any) -> None:
        for param_name, name in self.names.items():
            if hasattr(module, param_name + MASK_SUFFIX):
                check_layer(PrunedLayer(name, module, param_name, "", getattr(module, param_name),
                                        transposed=is_conv1d_gemm(module)))


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


def add_checkpoint_hooks(layers: list[PrunedLayer], handle: SparseHandle) -> list[Any]:
    """Register, on every pruned module, the hooks that save and load its masks (and pruned values) and check
    them at ``load_state_dict``; returns the hook handles."""
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
