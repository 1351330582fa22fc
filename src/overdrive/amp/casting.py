"""Casting a model for O2/O3: half weights, fp32 norm layers, fp32 master copies, input/output casts.

Only public mechanisms are used: parameters are swapped on their modules, and inputs/outputs are
cast by forward hooks. No torch function, optimizer method or ``forward`` is patched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.trees import map_tensors, tensor_leaves

# Normalization layers that O2 keeps in fp32 (apex: keep_batchnorm_fp32 covers every norm layer).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)
if hasattr(nn, "RMSNorm"):
    NORM_TYPES = (*NORM_TYPES, nn.RMSNorm)
# BatchNorm accepts half inputs with fp32 parameters natively (cuDNN and CPU); the others get a cast.
_NATIVE_MIXED = (nn.modules.batchnorm._BatchNorm,)


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, with finite values beyond ``dtype``'s range clamped to its largest finite value.

    A plain cast turns them into inf: an additive attention mask filled with ``torch.finfo(torch.float32).min``
    becomes -inf in bfloat16 (and a -1e9 mask -inf in float16), and a row with every key masked then gives
    NaN in softmax (``-inf - -inf``) or in ``mask * 0``. Clamped, the row stays finite, as in float32.
    inf and NaN stay what they are.

    Example:
        >>> saturating_cast(torch.tensor([torch.finfo(torch.float32).min, -1.0]), torch.bfloat16).isinf().tolist()
        [False, False]
    """
    if not x.is_floating_point() or x.dtype == dtype:
        return x
    top = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max > top:
        x = torch.where(torch.isinf(x), x, x.clamp(-top, top))
    return x.to(dtype)


def cast_floating(obj: Any, dtype: torch.dtype, saturate: bool = False) -> Any:
    """Cast every floating-point tensor inside ``obj`` (nested tuples/lists/dicts, namedtuples, dataclass
    instances) to ``dtype``; ``saturate`` clamps finite values out of ``dtype``'s range to its limits instead of
    letting them become inf (:func:`saturating_cast`). Containers holding nothing to cast come back as they were.

    Example:
        >>> cast_floating({"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.long)}, torch.bfloat16)["x"].dtype
        torch.bfloat16
    """

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return saturating_cast(x, dtype) if saturate else x.to(dtype)
        return x

    return map_tensors(cast, obj)


def cast_model(
    model: nn.Module,
    dtype: torch.dtype,
    keep_norm_fp32: bool,
    make_masters_for: set[int],
    replaced: dict[int, nn.Parameter] | None = None,
) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Cast ``model``'s floating parameters and buffers to ``dtype`` in place of the originals.

    Parameters whose id is in ``make_masters_for`` (those an optimizer holds) are replaced on the
    module by a new half Parameter; the original fp32 Parameter object stays in the optimizer and
    becomes the master copy, so optimizer references and any state stay valid. Others are cast
    in place. Tied parameters stay tied; pass one ``replaced`` dict (id of an original parameter
    -> what took its place) to every model of one run, so a parameter shared between two models
    stays shared too. Returns (model_param, master_param) pairs.
    """
    replaced = {} if replaced is None else replaced
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
    for mod_name, module in model.named_modules():
        if keep_norm_fp32 and isinstance(module, NORM_TYPES):
            continue
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) in replaced:  # tied weight, already cast through another module (or model)
                module._parameters[name] = replaced[id(p)]
                continue
            if id(p) in make_masters_for:
                if p.dtype in (torch.float16, torch.bfloat16):
                    # apex refused this too: the master would be a half copy, and fp32 master weights
                    # are the point of O2. Seen after model.half() or on a model already initialized.
                    full = f"{mod_name}.{name}" if mod_name else name
                    raise UsageError(
                        f"parameter {full!r} is already {p.dtype}, but O2's master weights must start from float32; "
                        "pass the float32 model to amp.initialize/prepare (no .half() or .to(torch.bfloat16) before "
                        "it, and initialize each model once)"
                    )
                half = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                replaced[id(p)] = half
                module._parameters[name] = half
                pairs.append((half, p))
            elif p.dtype != dtype:
                p.data = p.data.to(dtype)
                replaced[id(p)] = p
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = b.to(dtype)
    return pairs


class CastHook:
    """A forward pre-hook (``where="inputs"``) or forward hook (``"outputs"``) that casts floating tensors to
    ``dtype``. A class, not a closure: the hooks live on the model, and ``torch.save(model)`` pickles them."""

    def __init__(self, dtype: torch.dtype, where: str) -> None:
        self.dtype, self.where = dtype, where

    def __call__(self, _m: nn.Module, args: Any, *rest: Any) -> Any:
        if self.where == "inputs":  # registered with_kwargs=True: (module, args, kwargs)
            # saturate: a model's inputs hold additive attention masks (float32's min, -1e9) that overflow half
            return cast_floating(args, self.dtype, saturate=True), cast_floating(rest[0], self.dtype, saturate=True)
        if self.where == "args":  # a plain pre-hook: (module, args)
            return cast_floating(args, self.dtype)
        return cast_floating(rest[-1], self.dtype)  # a forward hook: (module, args, output)


def add_io_cast_hooks(model: nn.Module, input_dtype: torch.dtype, output_dtype: torch.dtype | None) -> list[Any]:
    """Cast floating inputs to ``input_dtype`` on entry and outputs to ``output_dtype`` on exit."""
    handles = [model.register_forward_pre_hook(CastHook(input_dtype, "inputs"), with_kwargs=True)]
    if output_dtype is not None:
        handles += add_output_cast_hook(model, output_dtype)
    return handles


def add_output_cast_hook(model: nn.Module, dtype: torch.dtype) -> list[Any]:
    """Cast ``model``'s floating outputs to ``dtype`` (apex's ``cast_model_outputs``)."""
    return [model.register_forward_hook(CastHook(dtype, "outputs"))]


def add_norm_fp32_hooks(model: nn.Module, half: torch.dtype) -> list[Any]:
    """fp32 norm layers other than BatchNorm compute in fp32 and hand ``half`` back to the model."""
    handles = []
    for module in model.modules():
        if isinstance(module, NORM_TYPES) and not isinstance(module, _NATIVE_MIXED):
            handles.append(module.register_forward_pre_hook(CastHook(torch.float32, "args")))
            handles.append(module.register_forward_hook(CastHook(half, "outputs")))
    return handles


class AutocastRegion:
    """torch.autocast entered by a model's forward pre-hook and left by its forward hook (apex O1 without
    patching torch). Several models (and nested calls) share one region: it is entered once, by the
    outermost forward, and left when that forward ends.

    ``scope="step"`` (the apex surface) keeps it open after a training forward (module in training mode,
    grad enabled) while the forward's outputs are alive, so the loss and any other function the training
    step calls on them before ``scale_loss`` run under it too, as under apex's patched torch. It is left by
    :meth:`close` (``scale_loss``, the optimizer step), or when the last output of the step's forwards is
    freed (``model(x).dtype`` does not leave autocast on), whichever comes first. An eval or no-grad forward
    leaves it at its end. Picklable: ``torch.save(model)`` saves the hooks with no region open.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, scope: str = "forward") -> None:
        if scope not in ("forward", "step"):
            raise UsageError(f"autocast scope {scope!r} is not 'forward' or 'step'")
        self.device_type, self.dtype, self.scope = device_type, dtype, scope
        self._open: list[Any] = []  # torch.autocast, then the registered-casts mode if any (left in reverse)
        self._depth = 0  # forwards in flight
        self._outputs = 0  # outputs of this step's training forwards still alive
        self._generation = 0  # bumped by close(): finalizers of outputs from an earlier step do nothing

    def __getstate__(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "dtype": self.dtype, "scope": self.scope}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    # The hooks run eagerly even inside torch.compile: Dynamo cannot trace an autocast context that
    # is entered in one hook and left in another, but it compiles the forward under the autocast
    # state the hooks set, as it would under a ``with torch.autocast(...)`` around the call.
    @torch._dynamo.disable
    def enter(self, _m: nn.Module, _args: Any) -> None:
        if not self._open:
            ctx = torch.autocast(device_type=self.device_type, dtype=self.dtype)
            ctx.__enter__()
            self._open.append(ctx)
            from overdrive.amp import functions  # (functions imports this module)

            if functions.TORCH_REGISTERED:  # register_float_function(torch, "sigmoid") and the like
                mode = functions.RegisteredCasts()
                mode.__enter__()
                self._open.append(mode)
        self._depth += 1

    @torch._dynamo.disable
    def leave(self, module: nn.Module, _args: Any, out: Any) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth:
            return
        outputs = tensor_leaves(out) if out is not None else []
        if not (self.scope == "step" and module.training and torch.is_grad_enabled() and outputs):
            self.close()
            return
        for t in outputs:
            self._outputs += 1
            weakref.finalize(t, self._output_freed, self._generation)

    def _output_freed(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._outputs -= 1
        if self._outputs <= 0 and self._depth == 0:
            self.close()

    @torch._dynamo.disable
    def close(self) -> None:
        """Leave the region if it is open (autocast as it was before the forward)."""
        self._depth = 0
        self._outputs = 0
        self._generation += 1
        while self._open:
            self._open.pop().__exit__(None, None, None)

    @property
    def is_open(self) -> bool:
        return bool(self._open)


class _RegionHook:
    """The forward (pre-)hook that calls one side of an :class:`AutocastRegion`; picklable."""

    def __init__(self, region: AutocastRegion, side: str) -> None:
        self.region, self.side = region, side

    def __call__(self, *args: Any) -> None:
        getattr(self.region, self.side)(*args)


def add_autocast_hooks(model: nn.Module, device_type: str, dtype: torch.dtype,
                       region: AutocastRegion | None = None) -> list[Any]:
    """Run ``model``'s forward under torch.autocast (apex O1 without patching torch).

    The exit hook is registered with ``always_call=True``, so an exception in forward still
    leaves autocast as it was. Pass one ``region`` to several models to share it (see :class:`AutocastRegion`).
    """
    region = region or AutocastRegion(device_type, dtype)
    return [model.register_forward_pre_hook(_RegionHook(region, "enter")),
            model.register_forward_hook(_RegionHook(region, "leave"), always_call=True)]


def add_master_sync_on_load(model: nn.Module, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> list[Any]:
    """Make ``model.load_state_dict`` update the fp32 masters of O2 too, not only the half weights.

    Without this the next optimizer step copies the old masters back over the loaded weights.
    A pre-hook keeps the checkpoint's own values (fp32 where the checkpoint has them, so no
    precision is lost to the half round trip); a post-hook copies them into the masters once the
    half parameters are loaded. A value equal to the half weight it replaces (an O2 model's own
    state dict loaded after the amp state) leaves its master alone: that master is the same value
    with more bits. The hooks hold the parameters, not the :class:`MixedPrecision`; ``pairs`` is read
    at load time, so pairs added later (param groups added after prepare) are covered.
    """
    sync = _MasterSyncOnLoad(pairs)
    return [model.register_load_state_dict_pre_hook(sync.before), model.register_load_state_dict_post_hook(sync.after)]


class _MasterSyncOnLoad:
    """The two load-state-dict hooks of :func:`add_master_sync_on_load`. A class, not closures, so that
    ``torch.save(model)`` can pickle the model: the pickled hooks hold no pairs (a model loaded from the
    file has no optimizer, so no fp32 masters to keep in step)."""

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        self.pairs = pairs
        self.pending: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}  # id(module) -> (master, value)

    def __getstate__(self) -> dict[str, Any]:
        return {"pairs": [], "pending": {}}

    def before(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
               *_: Any) -> None:
        master_of = {id(h): (h, m) for h, m in self.pairs}
        if master_of and local_metadata.get("assign_to_params_buffers"):
            raise UsageError(
                "load_state_dict(..., assign=True) on a model prepared at O2 would replace the half parameters "
                "that amp pairs with fp32 masters; call load_state_dict without assign=True"
            )
        todo: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        # remove_duplicate=False: a tied weight is loaded under each of its names, the last one wins
        for name, param in module.named_parameters(remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if id(param) not in master_of or not isinstance(value, torch.Tensor) or value.shape != param.shape:
                continue  # not ours, missing, or a mismatch that load_state_dict itself reports
            half, master = master_of[id(param)]
            if value.dtype == half.dtype and torch.equal(value.to(half.device), half.detach()):
                todo.pop(id(param), None)
            else:
                todo[id(param)] = (master, value)
        self.pending[id(module)] = list(todo.values())

    def after(self, module: nn.Module, _incompatible: Any) -> None:
        with torch.no_grad():
            for master, value in self.pending.pop(id(module), []):
                master.copy_(value)  # to the master's fp32 and device


def param_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """{qualified name: dtype} for every parameter; handy in tests and reports."""
    return {n: p.dtype for n, p in model.named_parameters()}


def flatten(xs: Any) -> list[Any]:
    return list(xs) if isinstance(xs, (list, tuple)) else [xs]


def ids(params: Iterable[torch.Tensor]) -> set[int]:
    return {id(p) for p in params}


Hook = Callable[..., Any]
