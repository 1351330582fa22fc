"""The native mixed-precision API: :func:`prepare` returns a :class:`MixedPrecision` you hold.

One implementation: the apex surface (``amp.initialize`` / ``amp.scale_loss``) and the training
loop both drive this class.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.amp import casting, fp8
from overdrive.amp.config import Policy
from overdrive.amp.guard import StepGuard, read_flags
from overdrive.amp.resume import AmpState
from overdrive.amp.scaler import LossScaler
from overdrive.amp.steps import LOSS_WHY, StepChecks
from overdrive.amp.verdicts import VerdictQueue, any_flag


class MixedPrecision(StepChecks, AmpState):
    """Models and optimizers prepared for one :class:`Policy`; owns the loss scaler.

    No optimizer step with inf/NaN gradients or loss is applied: it is skipped and counted
    (:attr:`skipped_steps`), with a warning or an error as the policy's ``on_nonfinite`` says
    (:mod:`overdrive.amp.guard`).

    Example:
        >>> from overdrive.amp import prepare
        >>> model = nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mp = prepare(model, opt, Policy(opt_level="O2", dtype=torch.bfloat16))
        >>> with mp.autocast():
        ...     loss = model(torch.randn(8, 4).to(torch.bfloat16)).float().square().mean()
        >>> mp.backward(loss); _ = mp.step(); mp.zero_grad()
        >>> model.weight.dtype, next(iter(mp.master_params())).dtype
        (torch.bfloat16, torch.float32)
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        policy: Policy,
        device: torch.device,
        autocast_hooks: bool = True,
        num_losses: int = 1,
        autocast_scope: str = "forward",
    ) -> None:
        self.models = list(models)
        self.optimizers = list(optimizers)
        for opt in self.optimizers:
            earlier = _prepared_by(opt)
            if earlier is not None:
                # At O2 a second prepare saw the fp32 masters as no model's parameters and the model's half copies
                # as no optimizer's: the half gradients reached the masters still multiplied by the loss scale.
                raise UsageError(
                    f"this {type(opt).__name__} was already prepared (opt_level {earlier.policy.opt_level!r}) by an "
                    "earlier amp.prepare / amp.initialize / Trainer, whose hooks are still on it; prepare each model "
                    "and optimizer once and keep that MixedPrecision (or call .remove() on the earlier one first; "
                    "after O2, whose prepare made the model half, build a new model and optimizer)"
                )
        self.policy = policy.resolve(device)
        self.device = device
        p = self.policy
        if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
            raise UsageError(f"num_losses={num_losses!r} must be an int >= 1 (one loss scaler per loss)")
        # one scaler per loss (apex's num_losses): a GAN's discriminator loss backs off its own scale only
        self.scalers = [LossScaler(
            dynamic=p.dynamic, init_scale=p.init_scale if p.dynamic else float(p.loss_scale),
            growth_factor=p.growth_factor, backoff_factor=p.backoff_factor,
            growth_interval=p.growth_interval, min_scale=p.min_loss_scale, max_scale=p.max_loss_scale,
            warn_after=None,  # the guard speaks for every skipped step, and stops a run that cannot recover
        ) for _ in range(num_losses)]
        self.region = casting.AutocastRegion(device.type, p.dtype, autocast_scope) if p.autocast else None
        self.guard = StepGuard(p.on_nonfinite, p.max_consecutive_skips, n_optimizers=len(self.optimizers))
        # An optimizer may hold state already: a resume that loads optimizer.pt before amp.initialize (Hugging Face's
        # run_glue/run_squad, their Trainer v3). Its state stays keyed to the parameters it holds: under O2 those
        # become the fp32 masters (cast_model gives the model new half parameters), so the state stays fp32, as
        # apex's re-keying onto its masters left it; under O3 it follows the parameters' cast (below).
        # fp8: swap the chosen Linear layers first; they keep their Parameter objects, so the cast below
        # (half copies, fp32 masters) treats them like any other layer
        self.fp8_layers: list[fp8.LayerChoice] = []  # every Linear layer of every model, with the fp8 choice
        self._compile_check: fp8.CompileCheck | None = None
        self._fp8_row_hooks: list[Any] = []  # fp8 layers refuse a token count fp8 GEMMs cannot take
        if p.fp8 is not None:
            for k, model in enumerate(self.models):
                prefix = f"{k}:" if len(self.models) > 1 else ""
                self.fp8_layers += [dataclasses.replace(c, name=prefix + c.name) for c in fp8.convert(model, p.fp8)]
            self._compile_check = fp8.CompileCheck([m for model in self.models for m in fp8.fp8_modules(model)],
                                                   warn=not p.fp8.emulate)
        self._fp8_row_hooks = fp8.check_rows([m for model in self.models for m in fp8.fp8_modules(model)])
        opt_ids = casting.ids(q for opt in self.optimizers for g in opt.param_groups for q in g["params"])
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (model half, fp32 master)
        self._hooks: list[Any] = []
        replaced: dict[int, nn.Parameter] = {}  # shared by all models: a parameter two models share stays shared
        for model in self.models:
            if p.cast_model_type is not None:
                self._pairs += casting.cast_model(
                    model, p.cast_model_type, bool(p.keep_batchnorm_fp32), opt_ids if p.master_weights else set(),
                    replaced,
                )
                self._hooks += casting.add_io_cast_hooks(model, p.cast_model_type, p.cast_model_outputs)
                if p.keep_batchnorm_fp32:
                    self._hooks += casting.add_norm_fp32_hooks(model, p.cast_model_type)
                if p.master_weights:
                    self._hooks += casting.add_master_sync_on_load(model, self._pairs)
            elif p.cast_model_outputs is not None:
                # apex casts outputs at every opt level when asked to, not only for a cast model
                self._hooks += casting.add_output_cast_hook(model, p.cast_model_outputs)
            if self.region is not None and autocast_hooks:
                self._hooks += casting.add_autocast_hooks(model, device.type, p.dtype, self.region)
        _cast_state_like_params(self.optimizers)
        self._skip: set[int] = set()  # ids of optimizers whose next step is skipped (overflow)
        # ids of optimizers that an overflowing backward reached without being named in its scale_loss: their next
        # step checks the gradients it would apply (they may have been zeroed and recomputed since)
        self._check: set[int] = set()
        self._why: dict[int, str] = {}  # optimizer id -> why its pending skip is not a routine backoff
        self._bad_loss: dict[int, torch.Tensor] = {}  # static scales: optimizer id -> inf/NaN loss flag (device)
        self._n_groups = {id(opt): len(opt.param_groups) for opt in self.optimizers}  # to see add_param_group
        # defer_checks(): the inf/NaN verdicts travel to the host while the GPU works on, and are read a step later
        self.deferred = False
        self._verdicts = VerdictQueue()  # flags of backwards and steps not yet read, in order
        self._dev_skip: torch.Tensor | None = None  # 0-d, > 0: the next step is skipped (on the device)
        # scale_loss(delay_unscale=True): gradients left scaled in place since the first delayed backward, with what
        # that backward kept aside (the gradients before it, unscaled), its scaler, optimizers and inf/NaN-loss flag
        self._delayed: dict[str, Any] | None = None
        self._deferred_why: str | None = None  # what the read verdicts say the next skipped step is for
        self._numbers: dict[int, int] = {}  # optimizer index -> the number step() was given for its next step
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._before_step))
            self._hooks.append(opt.register_step_post_hook(self._after_step))

    @property
    def scaler(self) -> LossScaler:
        """The loss scaler of loss 0 (the only one unless ``num_losses`` > 1), with every verdict read."""
        self._settle()
        return self.scalers[0]

    # --- parameters -------------------------------------------------------------------------
    def master_pairs(self, optimizer: torch.optim.Optimizer | None = None) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """O2: (half model parameter, fp32 master) pairs, those ``optimizer`` steps (default: all); empty at
        other levels."""
        self._adopt_added_groups()
        if optimizer is None:
            return list(self._pairs)
        mine = casting.ids(self.master_params(optimizer))
        return [(h, m) for h, m in self._pairs if id(m) in mine]

    def master_params(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[nn.Parameter]:
        """The parameters the optimizer steps (fp32 masters under O2), for clipping and inspection."""
        for opt in [optimizer] if optimizer is not None else self.optimizers:
            for group in opt.param_groups:
                yield from group["params"]

    def _adopt_added_groups(self) -> None:
        """O2: param groups added after prepare (``optimizer.add_param_group``, e.g. to unfreeze a
        backbone) hold the model's half parameters; give them fp32 masters, as apex did, instead of
        letting the optimizer step half weights. Cheap when nothing was added (a length check)."""
        if not self.policy.master_weights:
            return
        for opt in self.optimizers:
            seen = self._n_groups[id(opt)]
            if len(opt.param_groups) == seen:
                continue
            self._n_groups[id(opt)] = len(opt.param_groups)
            in_model = casting.ids(q for model in self.models for q in model.parameters())
            paired = casting.ids(h for h, _ in self._pairs)
            for group in opt.param_groups[seen:]:
                for i, half in enumerate(group["params"]):
                    if (id(half) not in in_model or id(half) in paired or half.dtype != self.policy.cast_model_type
                            or half in opt.state):
                        continue  # not a half model weight (fp32 norm, new layer), or stepped already
                    master = nn.Parameter(half.detach().float(), requires_grad=half.requires_grad)
                    if half.grad is not None:
                        master.grad, half.grad = half.grad.float(), None
                    group["params"][i] = master
                    self._pairs.append((half, master))
                    paired.add(id(half))

    def _direct_params(self) -> list[nn.Parameter]:
        """Optimizer params that backward writes to directly: all of them, except O2's masters
        (whose grads arrive through the half model params). Under O2 these are the fp32 norm layers."""
        masters = casting.ids(m for _, m in self._pairs)
        return [q for q in self.master_params() if q.requires_grad and id(q) not in masters]

    # --- forward / backward -----------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """torch.autocast for O1; nothing at other levels (the model is already cast)."""
        if self.policy.autocast:
            return torch.autocast(device_type=self.device.type, dtype=self.policy.dtype)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scale_loss(
        self, loss: torch.Tensor, optimizers: Sequence[torch.optim.Optimizer] | None = None, loss_id: int = 0,
        delay_unscale: bool = False,
    ) -> Iterator[torch.Tensor]:
        """Yield ``loss * scale``; on exit unscale the new gradients and check them for inf/NaN.

        Gradients accumulated by earlier backward passes are kept aside while this one runs, so
        gradient accumulation over several ``scale_loss`` blocks is exact. ``delay_unscale=True`` (apex's, for
        accumulation under DDP's ``no_sync``) leaves this backward's gradients scaled in place instead, and the next
        ``scale_loss`` backward adds to them in place, so the backward that all-reduces (DDP's last micro-batch)
        reduces the whole accumulated gradient; the first ``scale_loss`` without it (or the next step) unscales and
        checks them all. (Kept aside, the earlier micro-batches' gradients were never all-reduced: the replicas of
        a DDP model drifted apart.) On an overflow the next
        step of ``optimizers`` (default: all of this object's) is skipped, as apex skips the ones passed
        to it; any other optimizer whose parameters this backward reached checks its gradients at its
        next step, and skips it only if they still hold inf/NaN (not after its zero_grad and a clean backward).
        ``loss_id`` picks the loss scaler (``num_losses`` > 1).
        """
        self.close_autocast()  # the loss is computed: backward runs outside O1's training-step region
        if not 0 <= loss_id < len(self.scalers):
            raise UsageError(f"loss_id={loss_id} but there are {len(self.scalers)} loss scaler(s); pass "
                             f"num_losses={loss_id + 1} or more to initialize/prepare")
        self._settle()  # the last step's verdicts: its flags have long reached the host (the forward ran since)
        scaler = self.scalers[loss_id]
        # a 0-d bool on the loss's device, read with the gradient check (no host sync of its own)
        loss_bad = torch.isfinite(loss.detach()).all().logical_not()
        pending = self._delayed
        if pending is not None and pending["scaler"] is not scaler:  # another loss's scale: settle the delayed first
            self._finish_delayed()
            pending = None
        if pending is None:
            self._adopt_added_groups()
            self._flush_pending()
            direct = self._direct_params()
            stash = [q.grad for q in direct]
            for q in direct:
                q.grad = None
        else:  # gradients scaled in place by an earlier delayed backward: this one adds to them where they are
            direct, stash = pending["direct"], pending["stash"]
            loss_bad = loss_bad | pending["loss_bad"].to(loss_bad.device)
        try:
            yield loss * scaler.scale if scaler.scale != 1.0 else loss
        except BaseException:
            if pending is None and not delay_unscale:
                for q, g in zip(direct, stash):
                    q.grad = g
            raise
        # the optimizers these backwards are for (None: all): the delayed ones' and this one's
        earlier = [] if pending is None else pending["optimizers"]
        named = (None if earlier is None or optimizers is None
                 else [*earlier, *[o for o in optimizers if o not in earlier]])
        if delay_unscale:
            self._delayed = {"scaler": scaler, "direct": direct, "stash": stash, "loss_bad": loss_bad,
                             "optimizers": named}
            return
        self._delayed = None
        self._unscale_new_grads(direct, stash, named, loss_bad, scaler)

    def _finish_delayed(self) -> None:
        """Unscale and check the gradients a delayed ``scale_loss`` left scaled in place (a step came first)."""
        pending, self._delayed = self._delayed, None
        if pending is not None:
            self._unscale_new_grads(pending["direct"], pending["stash"], pending["optimizers"], pending["loss_bad"],
                                    pending["scaler"])

    def backward(self, loss: torch.Tensor) -> None:
        """Scaled backward with the overflow check: ``with scale_loss(loss) as s: s.backward()``."""
        with self.scale_loss(loss) as scaled:
            scaled.backward()

    def _unscale_new_grads(
        self,
        direct: list[nn.Parameter],
        stash: list[torch.Tensor | None],
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        loss_bad: torch.Tensor | None = None,
        scaler: LossScaler | None = None,
    ) -> None:
        scaler = scaler or self.scalers[0]
        # O2: the half model grads are copied into fp32 buffers first, so all new gradients are
        # unscaled and checked in one pass (one device sync when the scale is dynamic, which reads
        # the loss's flag too). A static scale only unscales here: the step checks (_before_step).
        pairs, bufs, n_new = self._copy_half_grads()
        reached = casting.ids([q for q in direct if q.grad is not None] + [m for _, m in pairs])
        fresh = [q.grad for q in direct if q.grad is not None]
        at_floor = scaler.scale <= scaler.min_scale
        grad_flag = scaler.unscale_and_check_(fresh + bufs)
        deferred = self.deferred and scaler.dynamic
        if deferred:  # read at the next backward; the next step skips on the device
            self._verdicts.push("backward", grad_flag, loss_bad, None, at_floor=at_floor)
            self._dev_skip = any_flag(self._dev_skip, grad_flag, loss_bad)
        found, bad_loss = read_flags(grad_flag, loss_bad) if scaler.dynamic and not deferred else (False, False)
        self._accumulate_masters(pairs, bufs, n_new)
        to_add = [(q.grad, s) for q, s in zip(direct, stash) if s is not None and q.grad is not None]
        if to_add:
            torch._foreach_add_([g for g, _ in to_add], [s for _, s in to_add])
        for q, s in zip(direct, stash):
            if q.grad is None and s is not None:
                q.grad = s
        if not deferred:
            scaler.update(found)
        # Only the optimizers this loss is for skip their next step for it: a GAN's generator must not lose its next
        # (clean) step to an overflow in the discriminator's loss. One whose grads the backward reached without being
        # named (the discriminator, under the generator's loss) checks the gradients it holds at its next step: skipped
        # if they still hold inf/NaN, applied if they were zeroed and recomputed since (its next clean step).
        named = self._named(optimizers)
        if not scaler.dynamic:
            if loss_bad is not None:  # kept on the device until the step reads it with the gradients' check
                for key in named:
                    prev = self._bad_loss.get(key)
                    self._bad_loss[key] = loss_bad if prev is None else prev | loss_bad.to(prev.device)
        elif found or bad_loss:
            affected = named
            self._skip.update(affected)
            self._check.update(self._reached(reached) - named)
            # backing off is routine; an inf/NaN loss, or an overflow at the floor scale, is not
            why = LOSS_WHY if bad_loss else self._floor_why(scaler) if at_floor else None
            if why is not None:
                for key in affected:
                    self._why.setdefault(key, why)

    def _reached(self, reached: set[int]) -> set[int]:
        """ids of this object's optimizers holding a parameter whose gradient a backward reached (``reached``: ids)."""
        return {id(opt) for opt in self.optimizers if any(id(q) in reached for q in self.master_params(opt))}

    def _named(self, optimizers: Sequence[torch.optim.Optimizer] | None) -> set[int]:
        """ids of this object's optimizers among ``optimizers`` (None: all of them)."""
        named = casting.ids(self.optimizers if optimizers is None else optimizers)
        return {id(opt) for opt in self.optimizers if id(opt) in named}

    def _copy_half_grads(self) -> tuple[list[tuple[nn.Parameter, nn.Parameter]], list[torch.Tensor], int]:
        """O2: fp32 copies of the half model grads; fresh masters get theirs as ``.grad`` directly."""
        pairs = [(h, m) for h, m in self._pairs if h.grad is not None]
        if not pairs:
            return [], [], 0
        new = [(h, m) for h, m in pairs if m.grad is None]
        acc = [(h, m) for h, m in pairs if m.grad is not None]
        bufs: list[torch.Tensor] = []
        dense: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fp32 buffer, half grad), copied in one foreach
        for h, m in new + acc:
            if h.grad.is_sparse:  # nn.Embedding(sparse=True): a sparse fp32 copy (a dense buffer cannot take it)
                buf = h.grad.to(m.dtype, copy=True)
            else:
                buf = torch.empty_like(m)
                dense.append((buf, h.grad))
            bufs.append(buf)
        for (_, m), buf in zip(new, bufs):
            m.grad = buf
        if dense:
            torch._foreach_copy_([b for b, _ in dense], [g for _, g in dense])
        return new + acc, bufs, len(new)

    def _accumulate_masters(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], bufs: list[torch.Tensor], n_new: int) -> None:
        if len(pairs) > n_new:
            torch._foreach_add_([m.grad for _, m in pairs[n_new:]], bufs[n_new:])
        for h, _ in pairs:
            h.grad = None

    def _flush_pending(self) -> None:
        """Half grads left by a backward outside scale_loss (unscaled) go to the masters as they are."""
        pairs, bufs, n_new = self._copy_half_grads()
        self._accumulate_masters(pairs, bufs, n_new)

    # --- conveniences for the native API ----------------------------------------------------
    def step(self, number: int | None = None, wait: bool = True) -> bool | None:
        """Step every optimizer; returns False when a step was skipped (inf/NaN gradients or loss).

        ``number`` is this step's number in your loop, which a warning or error about it names
        (default: the optimizer's steps since prepare, from 0). With :meth:`defer_checks` on, ``wait=False``
        returns None instead of waiting for the verdict (no host sync); :attr:`skipped_steps` counts it later.
        """
        if wait:
            self._settle()
        before = self.guard.skipped
        for i, opt in enumerate(self.optimizers):
            if number is not None:
                self._numbers[i] = number
            opt.step()
        if not wait and self.deferred:
            return None
        self._settle()
        return self.guard.skipped == before

    def close_autocast(self) -> None:
        """Leave O1's autocast region if a training forward left it open (``autocast_scope="step"``)."""
        if self.region is not None:
            self.region.close()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        for half, _ in self._pairs:
            half.grad = None
        # what was found in the gradients just dropped goes with them (a pending overflow skip stays, as in apex)
        self._bad_loss.clear()
        self._why.clear()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients the optimizers will apply (unscaled; the fp32 masters' under O2) to a total norm of
        ``max_norm``; returns the norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does.

        Call it between the backward and :meth:`step` (where a ``torch.amp.GradScaler`` loop calls ``unscale_``
        and then clips). Every gradient the step will apply is clipped: O2 half gradients that a plain
        ``loss.backward()`` left on the model (bf16 needs no loss scale) go to the fp32 masters first, and
        gradients a ``scale_loss(..., delay_unscale=True)`` left scaled are unscaled and checked first.

        Example:
            >>> import torch
            >>> from overdrive.amp import Policy, prepare
            >>> model = torch.nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> mp = prepare(model, opt, Policy(opt_level="O2", dtype=torch.bfloat16))
            >>> model(torch.randn(8, 4)).square().mean().backward()
            >>> norm = mp.clip_grad_norm_(1e-3)
            >>> bool(norm > 1e-3), round(torch.cat([q.grad.flatten() for q in mp.master_params()]).norm().item(), 6)
            (True, 0.001)
        """
        self._finish_delayed()  # scaled gradients clipped, then unscaled, would be clipped to max_norm / scale
        self._adopt_added_groups()
        self._flush_pending()  # O2: a plain backward's half gradients, not yet on the masters
        params = [q for q in self.master_params() if q.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    @property
    def loss_scale(self) -> float:
        self._settle()
        return self.scalers[0].scale

    def remove(self) -> None:
        """Remove every hook this object installed (the model stays cast, and its fp8 layers fp8)."""
        self._settle()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._compile_check is not None:
            self._compile_check.remove()
        for h in self._fp8_row_hooks:
            h.remove()
        self._fp8_row_hooks.clear()


def _prepared_by(optimizer: torch.optim.Optimizer) -> MixedPrecision | None:
    """The MixedPrecision whose step hooks are on ``optimizer`` (an earlier prepare, not removed), or None."""
    for hook in getattr(optimizer, "_optimizer_step_pre_hooks", {}).values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, MixedPrecision):
            return owner
    return None


def _cast_state_like_params(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """State made before the first step (Adagrad's accumulator) or loaded from a checkpoint follows a parameter cast
    in place (O3): its floating tensors take the parameter's dtype, as they would had the optimizer been built (or
    its state loaded) on the cast model."""
    for opt in optimizers:
        for q, st in opt.state.items():
            if not isinstance(st, dict) or not isinstance(q, torch.Tensor):
                continue
            for k, v in st.items():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == q.shape \
                        and v.dtype != q.dtype:
                    st[k] = v.to(q.dtype)
