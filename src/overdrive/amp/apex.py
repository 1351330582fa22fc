"""apex.amp's surface over :mod:`overdrive.amp.core`: port apex code by changing the import.

apex's functions take no handle (``amp.scale_loss(loss, optimizer)``, ``amp.state_dict()``), so
this module keeps a registry from optimizer to the :class:`MixedPrecision` that owns it. It holds
weak references only, and each ``initialize`` call gets its own entry: two models in one process
do not interfere. New code can hold the object from :func:`overdrive.amp.prepare` instead.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.amp import casting
from overdrive.amp.apex_state import AmpStash, AmpState, overflow_record
from overdrive.amp.config import Fp8, Policy
from overdrive.amp.api import prepare
from overdrive.amp.core import MixedPrecision
from overdrive.amp.guard import found_nonfinite, read_flags
from overdrive.amp.scaler import WARN_AFTER_SKIPS, LossScaler

# Values are weak too: a MixedPrecision holds its optimizers, so a strong value would keep its own
# key (and the model) alive forever. The optimizer's step hooks hold the MixedPrecision, which
# keeps it alive exactly as long as the optimizer the user passes to scale_loss.
_by_optimizer: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[MixedPrecision]] = (
    weakref.WeakKeyDictionary()
)
_in_order: list[weakref.ref[MixedPrecision]] = []
# Optimizers from initialize(..., enabled=False): scale_loss hands their loss back untouched, as apex did.
_disabled: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
# Optimizers whose gradients came from scale_loss(..., delay_overflow_check=True), with the scaler of that loss:
# their next step checks the gradients itself (the script may have all-reduced or rescaled them since).
_checked_at_step: weakref.WeakKeyDictionary[torch.optim.Optimizer, LossScaler] = weakref.WeakKeyDictionary()


def _bool_arg(value: Any) -> bool | None:
    if isinstance(value, str):  # apex accepted the strings "True"/"False" from argparse
        if value not in ("True", "False"):
            raise UsageError(f"keep_batchnorm_fp32={value!r}; expected True, False, 'True' or 'False'")
        return value == "True"
    return value


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | str | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    dtype: torch.dtype | str | None = None,
    on_nonfinite: str = "skip",
    max_consecutive_skips: int | None = WARN_AFTER_SKIPS,
    fp8: Fp8 | str | None = None,
) -> Any:
    """apex.amp.initialize: cast models and wire optimizers for ``opt_level``.

    Returns ``(models, optimizers)`` in the structure given (or only ``models`` when no
    optimizer was given). ``dtype`` picks float16 (default on CUDA) or bfloat16 (default on CPU).
    The positional order is apex's. ``num_losses`` gives each loss its own scaler (``scale_loss(...,
    loss_id=i)``), as apex's GAN examples use. O1's autocast covers the training step, as apex's patched torch
    did: from a training forward of the models until ``scale_loss`` (the loss and any function called between
    them run under it; see :class:`~overdrive.amp.casting.AutocastRegion`). ``optimizer._amp_stash`` and
    ``amp._amp_state.loss_scalers`` (this call's scalers, as apex resets them at each call) are views apex
    scripts read (:mod:`overdrive.amp.apex_state`); ``optimizer._lazy_init_maybe_master_weights()`` is accepted
    (the masters exist from this call on).
    ``patch_torch_functions`` is O1's op-level casting (torch.autocast
    here, nothing is patched): it may be given, with its opt level's value. ``enabled=False`` changes
    nothing, and ``scale_loss`` then yields the loss as it is. ``on_nonfinite`` and ``max_consecutive_skips``
    (keywords, not in apex) say what a step with inf/NaN gradients or loss does: see :class:`Policy`.
    ``fp8`` (a keyword, not in apex: ``"tensorwise"``, ``"rowwise"`` or an :class:`~overdrive.amp.Fp8`) trains the
    large Linear layers in fp8 on GPUs that have it (``amp.summary(model)`` lists them); compile the model after.

    Example:
        >>> model = nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, opt = initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
        >>> with scale_loss(model(torch.randn(3, 4)).sum(), opt) as scaled:
        ...     scaled.backward()
        >>> opt.step()
    """
    opt_list = [] if optimizers is None else (list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers])
    if not enabled:
        for opt in opt_list:
            _disabled.add(opt)
        return models if optimizers is None else (models, optimizers)
    if patch_torch_functions is not None and bool(patch_torch_functions) != (opt_level == "O1"):
        raise UsageError(
            f"patch_torch_functions={patch_torch_functions} at opt_level={opt_level!r}: op-level casting "
            "(torch.autocast here) is what O1 is, and only O1; use opt_level='O1' for it, or another level "
            "without it, and leave patch_torch_functions unset"
        )
    policy = Policy(
        opt_level=opt_level, dtype=dtype, cast_model_type=cast_model_type,
        keep_batchnorm_fp32=_bool_arg(keep_batchnorm_fp32), master_weights=master_weights,
        loss_scale=loss_scale, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
        cast_model_outputs=cast_model_outputs, on_nonfinite=on_nonfinite, max_consecutive_skips=max_consecutive_skips,
        fp8=fp8,
    )
    for opt in opt_list:
        if _lookup(opt) is not None:
            raise UsageError("this optimizer was already passed to amp.initialize; call initialize once per optimizer")
    # registered before prepare's hooks so that it runs first: a skip it decides is then counted and applied there
    delayed_checks = [opt.register_step_pre_hook(_check_delayed_overflow) for opt in opt_list]
    try:
        mp = prepare(models, opt_list, policy, num_losses=num_losses, autocast_scope="step")
    except BaseException:
        for h in delayed_checks:
            h.remove()
        raise
    if cast_model_outputs is None and mp.policy.autocast and mp.policy.dtype == torch.bfloat16:
        # apex's O1 hands back the model's fp16 outputs, which scripts read with .numpy() (Hugging Face's run_glue
        # evaluation); numpy has no bfloat16, so O1 in bfloat16 (the CPU's default) returns them in float32, as
        # cast_model_outputs=torch.float32 would
        # (first among the forward hooks: O1's autocast region then follows the outputs the caller gets)
        for model in mp.models:
            mp._hooks.append(model.register_forward_hook(casting.CastHook(torch.float32, "outputs"), prepend=True))
    for opt in opt_list:
        _by_optimizer[opt] = weakref.ref(mp)
        _disabled.discard(opt)
        # a data attribute apex scripts read (DLE BERT, ViT-pytorch), not a patched method
        opt._amp_stash = AmpStash(mp, opt)  # type: ignore[attr-defined]
        # a name torch's optimizers do not have, which DLE BERT's resume calls before copying into the masters
        opt._lazy_init_maybe_master_weights = _masters_made_at_initialize  # type: ignore[attr-defined]
    _in_order.append(weakref.ref(mp))
    return models if optimizers is None else (models, optimizers)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """apex's ``amp.disable_casts()``: the code inside runs without O1's casts (fp32 where the model is fp32), as
    DeepLearningExamples' Jasper featurizer and fp32 evaluation code use it.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), disable_casts():
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield


def _check_delayed_overflow(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """Before a step whose gradients came from ``scale_loss(..., delay_overflow_check=True)``: check them (one
    host sync) and skip the step on inf/NaN; update the scale here if the script did not call ``update_scale()``."""
    scaler = _checked_at_step.pop(optimizer, None)
    mp = _lookup(optimizer)
    if scaler is None or mp is None:
        return
    grads = [q.grad for q in master_params(optimizer) if q.grad is not None]
    record = overflow_record(scaler, mp.device)
    bad, flagged = read_flags(found_nonfinite(grads), record.buf if record.awaiting_update else None)
    if record.awaiting_update:
        record.awaiting_update = False
        scaler.update(bad or flagged)
    if bad:
        mp.set_pending_skips(mp.pending_skips() | {id(optimizer)})


def _masters_made_at_initialize() -> None:
    """``optimizer._lazy_init_maybe_master_weights()``: apex made the fp32 masters at the first step and scripts
    that load them earlier (DeepLearningExamples BERT's resume) call this first. Here ``initialize`` made them
    already, so there is nothing to do; ``amp.master_params(optimizer)`` are the masters to copy into."""


def _lookup(optimizer: torch.optim.Optimizer) -> MixedPrecision | None:
    """The MixedPrecision ``initialize`` made for ``optimizer``, if it is still alive."""
    ref = _by_optimizer.get(optimizer)
    return None if ref is None else ref()


def mixed_precision_of(optimizer: torch.optim.Optimizer) -> MixedPrecision | None:
    """The :class:`MixedPrecision` that ``amp.initialize`` made for ``optimizer`` (None if none is alive), for
    code that composes with an apex-style run (ASP after O2 finds the fp32 masters through it)."""
    return _lookup(optimizer)


def _handle(optimizers: Any) -> MixedPrecision | None:
    """The MixedPrecision that owns ``optimizers``; None when initialize had ``enabled=False``."""
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if opts and all(o in _disabled for o in opts):
        return None
    handles = {id(h): h for h in map(_lookup, opts)}
    if None in handles.values():
        raise UsageError(
            "scale_loss got an optimizer that amp.initialize never saw; pass the optimizer returned by "
            "amp.initialize(model, optimizer, ...)"
        )
    if len(handles) != 1:
        raise UsageError("scale_loss got optimizers from different amp.initialize calls; use one call per loss")
    return next(iter(handles.values()))  # type: ignore[return-value]


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """apex.amp.scale_loss: yield the scaled loss; on exit unscale the gradients, check overflow.

    ``delay_unscale=True`` leaves this backward's gradients scaled in place, as apex does, for accumulation under
    DDP's ``no_sync`` (the last, synced backward then all-reduces the whole sum); the next ``scale_loss`` without it,
    or the step, unscales and checks them. Without it accumulation over several ``scale_loss`` blocks is exact too,
    but each block's gradients are kept aside during the next backward, which DDP would not see. ``loss_id`` picks the scaler of ``initialize(..., num_losses=N)``.
    The overflow found is written to the scaler's ``_overflow_buf`` (``amp._amp_state.loss_scalers[loss_id]``).
    ``delay_overflow_check=True`` (a dynamic scale) leaves the scale and the step alone, as apex did, for a script
    that checks the gradients itself and calls the scaler's ``update_scale()`` (DeepLearningExamples BERT's
    all-reduce after accumulation); the next ``optimizer.step()`` then checks its gradients once more and skips
    inf/NaN ones, and updates the scale if ``update_scale()`` was not called.
    """
    handle = _handle(optimizers)
    if handle is None:  # amp.initialize(..., enabled=False): apex yields the loss unchanged
        yield loss
        return
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    scaler = handle.scalers[loss_id] if 0 <= loss_id < len(handle.scalers) else None  # else scale_loss raises
    before = None if scaler is None else (scaler.scale, scaler.unskipped, scaler.overflows, scaler.consecutive_skips)
    skips = handle.pending_skips()
    with handle.scale_loss(loss, opts, loss_id=loss_id, delay_unscale=delay_unscale) as scaled:
        yield scaled
    if scaler is None or before is None or delay_unscale:  # nothing checked yet: the overflow buffer stays as it was
        return
    found = scaler.overflows > before[2]  # the native check has run (and synced) for a dynamic scale
    record = overflow_record(scaler, handle.device)
    if delay_overflow_check and scaler.dynamic:
        # undo the native update: the script's update_scale(), or the step, makes it once per step
        scaler.scale, scaler.unskipped, scaler.overflows, scaler.consecutive_skips = before
        added = handle.pending_skips() - skips
        handle.set_pending_skips(skips)
        if not record.awaiting_update:  # the first delayed backward since the last update: a fresh flag
            record.buf.zero_()
        record.awaiting_update = True
        if found:
            record.buf.fill_(1)
        for opt in handle.optimizers:
            if opt in opts or id(opt) in added:
                _checked_at_step[opt] = scaler
    else:
        record.buf.fill_(int(found))
        for opt in opts:
            _checked_at_step.pop(opt, None)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[nn.Parameter]:
    """The parameters ``optimizer`` steps: fp32 masters under O2, the model's own otherwise."""
    for group in optimizer.param_groups:
        yield from group["params"]


def _live() -> list[MixedPrecision]:
    """The MixedPrecision of every initialize call whose models and optimizers are still in use."""
    if sum(r() is not None for r in _in_order) > 1:
        # A dropped model/optimizer pair and its MixedPrecision reference each other (the
        # optimizer's step hooks hold it), so only the cycle collector frees them. Collect before
        # counting, or a rebuilt run in the same process would also see the old one's scaler.
        # Only reached when several calls look alive, and only at checkpoint time.
        gc.collect()
    alive = [r() for r in _in_order]
    _in_order[:] = [r for r in _in_order if r() is not None]
    return [h for h in alive if h is not None]


_amp_state = AmpState(_live)  # apex's module attribute: a view over the live initialize calls, no state of its own


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """apex.amp.state_dict: one ``loss_scaler<i>`` entry per loss of each initialize call, in order.

    Each entry has apex's keys ``loss_scale`` and ``unskipped`` at its top level (code that reads
    ``amp.state_dict()['loss_scaler0']['loss_scale']`` keeps working); the first entry of each call
    carries overdrive's own state too (masters, and every scaler of a ``num_losses`` call).
    """
    out: dict[str, Any] = {} if destination is None else destination
    i = 0
    for h in _live():
        for k, s in enumerate(h.scalers):
            out[f"loss_scaler{i}"] = {"loss_scale": s.scale, "unskipped": s.unskipped, **(h.state_dict() if k == 0 else {})}
            i += 1
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    """apex.amp.load_state_dict: restore what :func:`state_dict` saved (after ``initialize``).

    Also reads checkpoints written by NVIDIA apex (``{'loss_scaler0': {'loss_scale', 'unskipped'}}``).
    """
    handles = _live()
    keys = sorted((k for k in state if k.startswith("loss_scaler")), key=lambda k: int(k.removeprefix("loss_scaler")))
    n = sum(len(h.scalers) for h in handles)
    if len(keys) != n:
        raise UsageError(
            f"amp state has {len(keys)} loss scaler(s) but the {len(handles)} live amp.initialize call(s) have {n}; "
            "call amp.initialize the same way as in the saved run (num_losses too) before amp.load_state_dict. Every "
            "initialize call whose model or optimizer is still referenced counts, an earlier run's too (a notebook, "
            "or a script that keeps the run it saved from): `del` that model and optimizer before resuming"
        )
    i = 0
    for h in handles:
        entries = [state[k] for k in keys[i:i + len(h.scalers)]]
        i += len(h.scalers)
        h.load_state_dict(entries[0])  # overdrive's format holds every scaler of the call; apex's, the first
        if "opt_level" not in entries[0]:
            for s, entry in zip(h.scalers[1:], entries[1:]):
                if s.dynamic:  # apex's entries restore a dynamic scale; a static one is this run's policy
                    s.load_state_dict({"loss_scale": entry["loss_scale"], "unskipped": entry["unskipped"]})
