"""apex-compatible ``ASP`` surface, a thin layer over :func:`sparsify` / :class:`SparseHandle`.

apex keeps one model per process in class attributes; here each model has its own handle in a
weak registry keyed by the model, so several models per process work and a deleted model frees
its entry. Calls that name no model (``compute_sparse_masks()``) act on the only registered model
and ask for ``model=`` when there are several.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity.api import from_pruned, sparsify
from overdrive.sparsity.config import SparsityConfig
from overdrive.sparsity.handle import SparseHandle
from overdrive.sparsity.layers import _TYPES
from overdrive.sparsity.pruned import MASK_SUFFIX

_HANDLES: weakref.WeakKeyDictionary[nn.Module, SparseHandle] = weakref.WeakKeyDictionary()
# The optimizers ASP attached to each handle, held weakly: under amp an optimizer's step hooks hold the
# MixedPrecision, which holds the model, so a strong reference from the registry's value would keep its key alive.
_ATTACHED: weakref.WeakKeyDictionary[SparseHandle, weakref.WeakSet[torch.optim.Optimizer]] = weakref.WeakKeyDictionary()
_DEFAULT_WHITELIST = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
# init_model_for_pruning's verbosity per handle: what compute_sparse_masks / restore_pruned_weights print later
_VERBOSITY: weakref.WeakKeyDictionary[SparseHandle, int] = weakref.WeakKeyDictionary()
_NAME_FILTERS = ("not in allowed_layer_names", "in disallowed_layer_names")


def _where(name: str, param_name: str, t: torch.Tensor) -> str:
    """``module::param of size=... and type=...``, as apex names a weight in its messages."""
    module_name = name[: -len(param_name) - 1] if name.endswith("." + param_name) else ""
    return f"{module_name}::{param_name} of size={t.shape} and type={t.dtype}"


def _say_layers(handle: SparseHandle, verbosity: int) -> None:
    """apex's init messages: 1+ the weights left dense for their shape or type (with the reason); 3+ every weight
    sparsified, the other parameters of those layers, and the weights the layer names filtered out."""
    for c in handle.skipped:
        name_filtered = c.skip_reason in _NAME_FILTERS
        if verbosity >= (3 if name_filtered else 1):
            w = getattr(c.module, c.param_name)
            what = "Not sparsifying" if name_filtered else "Auto skipping pruning"
            print(f"[ASP] {what} {_where(c.name, c.param_name, w)} for sparsity ({c.skip_reason})")
    if verbosity < 3:
        return
    for layer in handle.layers:
        print(f"[ASP] Sparsifying {_where(layer.name, layer.param_name, layer.weight)} for sparsity")
    pruned = {(id(layer.module), layer.param_name) for layer in handle.layers}
    seen: set[int] = set()
    for layer in handle.layers:
        if id(layer.module) in seen:
            continue
        seen.add(id(layer.module))
        prefix = layer.name[: -len(layer.param_name)]
        for p_name, p in layer.module.named_parameters(recurse=False):
            if (id(layer.module), p_name) not in pruned and not p_name.endswith(MASK_SUFFIX):
                print(f"[ASP] Not sparsifying {_where(prefix + p_name, p_name, p)}")


def _registered(model: nn.Module) -> nn.Module | None:
    """The model ASP registered, found through the wrappers users put around it after pruning (DDP, DataParallel,
    ``torch.compile``): ``ASP.compute_sparse_masks(ddp_model)`` after ``init_model_for_pruning(model)`` said the
    model was never initialized."""
    seen: set[int] = set()
    while isinstance(model, nn.Module) and id(model) not in seen:
        if model in _HANDLES:
            return model
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is None and isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            inner = model.module
        model = inner
    return None


def _type_names(whitelist: Sequence[type[nn.Module]]) -> tuple[str, ...]:
    if isinstance(whitelist, (type, str)):  # whitelist=nn.Linear: iterating the class raised a bare TypeError
        raise UsageError(f"whitelist={whitelist!r} is one entry, not a list of layer classes; pass a list, e.g. "
                         f"whitelist=[{getattr(whitelist, '__name__', whitelist)}]")
    names = []
    for cls in whitelist:
        match = [k for k, base in _TYPES.items() if isinstance(cls, type) and issubclass(cls, base)]
        if not match:
            raise UsageError(f"whitelist entry {cls!r} is not Linear, Conv1d/2d/3d, MultiheadAttention or a subclass")
        names.append(match[0])
    return tuple(dict.fromkeys(names))


class ASP:
    """apex.contrib.sparsity.ASP, same names and arguments.

    Example:
        >>> model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> ASP.prune_trained_model(model, opt)  # apex's verbosity=2: each pruned weight's sparsity
        [ASP] Enabled 50.00% sparsity for 0::weight of size=torch.Size([32, 32]) and type=torch.float32
        [ASP] Enabled 50.00% sparsity for 2::weight of size=torch.Size([16, 32]) and type=torch.float32
        >>> ASP.is_sparsity_enabled(model)
        True
    """

    @staticmethod
    def init_model_for_pruning(
        model: nn.Module,
        mask_calculator: str | Callable[[torch.Tensor], torch.Tensor] = "m4n2_1d",
        verbosity: int = 3,
        whitelist: Sequence[type[nn.Module]] = _DEFAULT_WHITELIST,
        allowed_layer_names: Sequence[str] | None = None,
        disallowed_layer_names: Sequence[str] = (),
        allow_recompute_mask: bool = False,
        custom_layer_dict: dict | None = None,
        allow_permutation: bool = True,
    ) -> SparseHandle:
        """Install all-ones masks on the prunable layers; masks are computed by compute_sparse_masks().

        ``mask_calculator`` is a name (``"m4n2_1d"``, ``"m4n2_2d_best"``, ...) or, as in apex, a callable
        ``weight -> mask`` of the weight's shape (nonzero keeps). ``custom_layer_dict`` (apex's): ``{LayerType:
        ["param", ...]}``, other layer types and the parameters of theirs to prune.

        ``verbosity`` prints apex's ``[ASP]`` lines: 1+ the weights skipped for their shape or type, with the
        reason; 2+ (``compute_sparse_masks``, ``restore_pruned_weights``) the sparsity each weight got or lost;
        3+ (here) every weight sparsified and the parameters left dense."""
        if _registered(model) is not None:
            raise UsageError("init_model_for_pruning was already called for this model (or the model it wraps); it "
                             "is already pruned")
        # SparsityConfig refuses a bare string (tuple("head") would be its characters), so pass the names as given
        mask_fn = mask_calculator if callable(mask_calculator) else None
        cfg = SparsityConfig(mask_calculator="m4n2_1d" if mask_fn else mask_calculator, layer_types=_type_names(whitelist),
                     allowed_layer_names=allowed_layer_names, disallowed_layer_names=disallowed_layer_names,
                     allow_recompute_mask=allow_recompute_mask, permutation=allow_permutation,
                     custom_layers=custom_layer_dict or ())
        if any(cls not in _TYPES.values() for cls in whitelist):
            # a subclass in the whitelist (MyLinear) selects only its instances, not every layer of its base type
            wanted = tuple(whitelist) + tuple(custom_layer_dict or ())
            names = tuple(n for n, mod in model.named_modules() if isinstance(mod, wanted)
                          and (cfg.allowed_layer_names is None or n in cfg.allowed_layer_names))
            cfg = cfg.replace(allowed_layer_names=names)
        if any(name.endswith(MASK_SUFFIX) for name, _ in model.named_buffers()):
            # a pruned model saved whole (torch.save(model)) or deep-copied carries its masks: adopt them (this said
            # "already pruned" and init_optimizer_for_pruning "init first": the fine-tuning could not resume)
            handle = from_pruned(model, cfg)
        else:
            handle = sparsify(model, cfg, compute_masks=False)
        handle.mask_fn = mask_fn
        handle._strong = None  # the registry value must not keep its key alive
        _HANDLES[model] = handle
        _VERBOSITY[handle] = verbosity
        _say_layers(handle, verbosity)
        return handle

    @staticmethod
    def init_optimizer_for_pruning(optimizer: torch.optim.Optimizer) -> None:
        """Keep masks applied after every ``optimizer.step()`` (a step post-hook, no patching).

        After ``amp.initialize(..., opt_level="O2")`` the optimizer steps fp32 masters of the model's half
        weights; the masks are then applied to both (pruning after O2 works as pruning before it)."""
        from overdrive.amp import mixed_precision_of

        mp = mixed_precision_of(optimizer)
        if mp is not None:
            for h in _HANDLES.values():
                h.use_masters(mp.master_pairs(optimizer))
        held = {id(q) for g in optimizer.param_groups for q in g["params"]}
        owners = [h for h in _HANDLES.values() if any(id(layer.original) in held or id(layer.weight) in held for layer in h.layers)]
        if not owners and not any(id(q) in held for h in _HANDLES.values() for q in h.model.parameters()):
            raise UsageError("no model initialized with ASP.init_model_for_pruning owns this optimizer's parameters; "
                             "call init_model_for_pruning(model) first")
        # an optimizer of an initialized model that holds none of its pruned weights (a frozen pruned backbone, only
        # a head trained): nothing of its steps to mask, as in apex
        for h in owners:
            attached = _ATTACHED.setdefault(h, weakref.WeakSet())
            if optimizer in attached:
                raise UsageError("ASP.init_optimizer_for_pruning was already called for this optimizer")
            h.attach(optimizer)
            h._optimizers.remove(optimizer)  # the registry keeps its weak record instead (see _ATTACHED)
            attached.add(optimizer)

    @staticmethod
    def compute_sparse_masks(model: nn.Module | None = None) -> None:
        """Compute 2:4 masks from the current weights (after the permutation search) and apply them."""
        handle = ASP._handle(model)
        handle.compute_masks()
        if _VERBOSITY.get(handle, 0) >= 2:  # apex's info: what each weight now holds
            for layer in handle.layers:
                kept = float(layer.mask.sum()) / max(layer.mask.numel(), 1)
                print(f"[ASP] Enabled {100.0 - 100.0 * kept:.2f}% sparsity for "
                      f"{_where(layer.name, layer.param_name, layer.weight)}")

    @staticmethod
    def restore_pruned_weights(model: nn.Module | None = None) -> None:
        """Put the pruned weight values back (needs allow_recompute_mask=True) and reset masks to all ones;
        weights trained since pruning keep their trained values."""
        handle = ASP._handle(model)
        was_sparse = [layer for layer in handle.layers if not bool(layer.mask.all())]
        handle.restore_dense()
        if _VERBOSITY.get(handle, 0) >= 2:
            for layer in was_sparse:
                module_name = layer.name[: -len(layer.param_name) - 1] if "." in layer.name else ""
                print(f"[ASP] Disabled sparsity for {module_name}::{layer.param_name} (dense weights restored)")

    @staticmethod
    def is_sparsity_enabled(model: nn.Module | None = None) -> bool:
        """True when some mask prunes something (False before any model is initialized, as in apex)."""
        if model is None and not _HANDLES:
            return False
        return any(not bool(layer.mask.all()) for layer in ASP._handle(model).layers)

    @staticmethod
    def already_init_asp_model(model: nn.Module | None = None) -> bool:
        """Whether ``model`` (apex's form, no argument: any model in this process) was initialized for pruning."""
        if model is None:
            return len(_HANDLES) > 0
        return _registered(model) is not None

    @staticmethod
    def set_permutation_saving_params(allow_permutation: bool = True, save_permutation_graph: bool = False,
                                      permutation_output_dir: str = ".") -> None:
        """Accepted for apex scripts; nothing to set. The permutation is switched per model
        (``init_model_for_pruning(..., allow_permutation=)``) and reported in ``ASP.handle(model).report()``;
        overdrive writes no permutation graph files."""
        if not isinstance(allow_permutation, bool) or not isinstance(save_permutation_graph, bool):
            raise UsageError("set_permutation_saving_params takes booleans allow_permutation and save_permutation_graph")

    @staticmethod
    def handle(model: nn.Module | None = None) -> SparseHandle:
        """The native handle behind a model ASP pruned (for report/export)."""
        return ASP._handle(model)

    @staticmethod
    def prune_trained_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The one-call recipe: init model (m4n2_1d, Linear and Conv2d layers, as apex), init optimizer, compute
        masks."""
        # apex passes whitelist=[Linear, Conv2d] here: the default list (Conv1d/3d, MultiheadAttention too) pruned
        # more of a ported model than apex did
        ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[nn.Linear, nn.Conv2d],
                                   allow_recompute_mask=False)
        ASP.init_optimizer_for_pruning(optimizer)
        ASP.compute_sparse_masks(model)

    @staticmethod
    def _handle(model: nn.Module | None) -> SparseHandle:
        if model is not None:
            registered = _registered(model)
            if registered is None:
                raise UsageError(f"this {type(model).__name__} was not initialized with "
                                 "ASP.init_model_for_pruning(model); initialize it (or the model it wraps) first")
            return _HANDLES[registered]
        handles = list(_HANDLES.values())
        if not handles:
            raise UsageError("no model initialized for pruning; call ASP.init_model_for_pruning(model) first")
        if len(handles) > 1:
            raise UsageError(f"{len(handles)} models are initialized for pruning; pass model= to say which one")
        return handles[0]
