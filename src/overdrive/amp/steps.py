"""The optimizer step side of :class:`~overdrive.amp.core.MixedPrecision`: the hooks around every step.

Before a step: unscale what a delayed backward left scaled, check the gradients (and the losses behind them) for
inf/NaN, immediately or a step late (:meth:`StepChecks.defer_checks`), and skip the step when they hold any. After
it: copy O2's fp32 masters back to the model's half weights. A mixin of ``MixedPrecision``; the attributes below
are set by its ``__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError
from overdrive.amp import casting
from overdrive.amp.guard import StepGuard, found_nonfinite, read_flags
from overdrive.amp.scaler import LossScaler
from overdrive.amp.verdicts import VerdictQueue, any_flag

if TYPE_CHECKING:
    from collections.abc import Iterator

    from overdrive.amp.config import Policy

LOSS_WHY = "the loss is inf or NaN"


class StepChecks:
    """The inf/NaN checks of each optimizer step and the O2 master copy after it (a mixin of ``MixedPrecision``)."""

    # set by MixedPrecision.__init__
    optimizers: list[torch.optim.Optimizer]
    policy: Policy
    scalers: list[LossScaler]
    guard: StepGuard
    deferred: bool
    _pairs: list[tuple[nn.Parameter, nn.Parameter]]
    _skip: set[int]
    _check: set[int]
    _why: dict[int, str]
    _bad_loss: dict[int, torch.Tensor]
    _verdicts: VerdictQueue
    _dev_skip: torch.Tensor | None
    _deferred_why: str | None
    _numbers: dict[int, int]

    if TYPE_CHECKING:  # MixedPrecision's, used here
        def master_params(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[nn.Parameter]: ...
        def close_autocast(self) -> None: ...
        def _finish_delayed(self) -> None: ...
        def _adopt_added_groups(self) -> None: ...
        def _flush_pending(self) -> None: ...

    # --- checks without a host sync per step ------------------------------------------------
    def defer_checks(self, enable: bool = True) -> bool:
        """Read the inf/NaN checks a step late, so a training step makes no host sync; returns whether that is on.

        By default every backward with a dynamic loss scale (and every step with a static one) reads its inf/NaN
        flag on the host, as apex does: on a GPU that waits for the queued work, and the GPU then idles while the
        host launches the next step. Deferred, the flag goes to the host in the background; an optimizer whose
        step takes torch's ``found_inf`` (Adam, AdamW, SGD and Adagrad with ``fused=True``) skips a bad step on
        the device, as with torch's GradScaler, and the loss scale, the skip count and any warning follow when
        the flag is read: at the next backward, or when :attr:`loss_scale`, :attr:`skipped_steps`,
        :meth:`state_dict` or ``step(wait=True)`` asks. A skipped step is then warned about one step late,
        naming its own step number. It needs one optimizer of that kind, one loss and ``on_nonfinite='skip'``
        (an error must stop the step it is about), and no sharded (DTensor) parameters; otherwise this returns
        False and every check stays immediate. :class:`~overdrive.train.Trainer` turns it on for CUDA runs.

        Example:
            >>> import torch
            >>> from overdrive.amp import Policy, prepare
            >>> model = torch.nn.Linear(4, 2); opt = torch.optim.AdamW(model.parameters(), fused=True)
            >>> mp = prepare(model, opt, Policy(opt_level="O1", dtype=torch.bfloat16))
            >>> mp.defer_checks()
            True
        """
        if not enable:
            self._settle()
            self.deferred = False
            return False
        opt = self.optimizers[0] if len(self.optimizers) == 1 else None
        self.deferred = (
            opt is not None and len(self.scalers) == 1 and self.policy.on_nonfinite == "skip"
            and bool(getattr(opt, "_step_supports_amp_scaling", False))
            and not any(hasattr(q, "to_local") for g in opt.param_groups for q in g["params"])
        )
        return self.deferred

    def _settle(self) -> None:
        """Read every deferred verdict, in order: loss-scale updates, step counts, warnings."""
        for v, (grad_bad, loss_bad, skip) in self._verdicts.drain():
            if v.kind == "backward":
                self.scalers[0].update(grad_bad or loss_bad)
                if (grad_bad or loss_bad) and self._deferred_why is None:
                    self._deferred_why = LOSS_WHY if loss_bad else self._floor_why(self.scalers[0]) if v.at_floor else None
                continue
            if v.number is not None:
                self.guard.number(0, v.number)
            why, self._deferred_why = self._deferred_why, None
            if skip:
                if v.kind == "static":
                    why = LOSS_WHY if loss_bad else self._static_why() if grad_bad else why
                self.guard.step_skipped(0, why)  # counts; warns; may stop a run that cannot recover
            else:
                self.guard.step_taken(0)

    @staticmethod
    def _floor_why(scaler: LossScaler) -> str:
        return (f"the gradients overflow (inf/NaN) even at the loss scale floor {scaler.min_scale:g}, so a "
                "smaller scale cannot help")

    def _static_why(self) -> str:
        scale = self.scalers[0].scale
        return "the gradients hold inf or NaN" + (f" (static loss scale {scale:g})" if scale != 1.0 else "")

    def _device_skip_ok(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step can skip on the device now: fused SGD with momentum makes its momentum
        buffers with ``empty_like`` at its first step and leaves them so when that step is skipped (garbage
        momentum), so its first step is checked on the host."""
        if not self.deferred or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
        if isinstance(optimizer, torch.optim.SGD):
            return all(g.get("momentum", 0) == 0 or all("momentum_buffer" in optimizer.state.get(q, {})
                                                         for q in g["params"]) for g in optimizer.param_groups)
        return True

    # --- optimizer step hooks ---------------------------------------------------------------
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        self._check_step(optimizer)
        if not self.policy.master_weights:
            return None
        # A closure (LBFGS, SAM-style optimizers) runs forward and backward inside the step, between updates of the
        # fp32 masters: the model's half copies must show the masters' current values to each call, and the half
        # gradients each call leaves must reach the masters the optimizer reads. Without this, LBFGS at O2 evaluated
        # the unchanged half model and saw no gradients: it trained nothing, silently.
        if len(args) > 1 and callable(args[1]):
            return (args[0], _MasterClosure(self, optimizer, args[1]), *args[2:]), kwargs
        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": _MasterClosure(self, optimizer, kwargs["closure"])}
        return None

    def _check_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.close_autocast()
        self._finish_delayed()  # delay_unscale's gradients, still scaled: unscaled and checked before they are applied
        self._adopt_added_groups()
        self._flush_pending()
        key = id(optimizer)
        index = self.optimizers.index(optimizer)
        number = self._numbers.pop(index, None)
        if key not in self._skip and self._device_skip_ok(optimizer):  # (a skip restored by load_pending_state: on the host)
            self._step_on_device(optimizer, number)
            return
        if self.deferred:  # this step is checked on the host: read what the backwards found first
            self._settle()
            if self._dev_skip is not None and read_flags(self._dev_skip)[0]:
                self._skip.add(key)
                self._why.setdefault(key, self._deferred_why)  # type: ignore[arg-type]
                if self._why[key] is None:
                    del self._why[key]
            self._dev_skip, self._deferred_why = None, None
        if number is not None:
            self.guard.number(index, number)
        why = self._why.pop(key, None)
        if not self.scalers[0].dynamic or key in self._check:
            # a dynamic scale checked each backward already; a static one (bf16's 1.0 too) checks here, and so does
            # an optimizer an overflowing backward reached without naming it
            self._check.discard(key)
            why = self._nonfinite_at_step(optimizer) or why
            if why is not None:
                self._skip.add(key)
        if key in self._skip:
            try:
                self.guard.step_skipped(index, why)  # counts; warns or raises as the policy says
            except OverdriveError:
                self._skip.discard(key)  # not applied (the error stops the step); the next one starts clean
                raise
            # Skip the step: optimizers leave parameters whose grad is None untouched.
            for q in self.master_params(optimizer):
                q.grad = None
        else:
            self.guard.step_taken(index)

    def _step_on_device(self, optimizer: torch.optim.Optimizer, number: int | None) -> None:
        """Deferred checks: the step skips itself on the device when the flag is set (torch's ``found_inf``)."""
        if self.scalers[0].dynamic:
            grad_flag = loss_flag = None
            skip, self._dev_skip = self._dev_skip, None
            kind = "step"
        else:  # a static scale checks the gradients this step applies, and the losses behind them
            loss_flag = self._bad_loss.pop(id(optimizer), None)
            grad_flag = found_nonfinite([q.grad for q in self.master_params(optimizer) if q.grad is not None])
            skip = any_flag(grad_flag, loss_flag)
            kind = "static"
        if skip is not None:
            params = [q for g in optimizer.param_groups for q in g["params"]]
            optimizer.found_inf = skip.reshape(()).to(params[0].device, torch.float32)  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
        self._verdicts.push(kind, grad_flag, loss_flag, skip, number=number)

    def _nonfinite_at_step(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Static scales: what is wrong with the step ``optimizer`` is about to take, or None. One fused
        check over the gradients it would apply (after accumulation and clipping) and the flags of the
        losses behind them: one host sync per step, none when it has no gradient."""
        loss_flag = self._bad_loss.pop(id(optimizer), None)
        grads = [q.grad for q in self.master_params(optimizer) if q.grad is not None]
        bad_grads, bad_loss = read_flags(found_nonfinite(grads), loss_flag)
        if bad_loss:
            return LOSS_WHY
        return self._static_why() if bad_grads else None

    def _after_step(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        for name in ("found_inf", "grad_scale"):  # a device-skipped step's flag is for that step only
            optimizer.__dict__.pop(name, None)
        # (a step skipped on the device left the masters as they were: copying them to the half weights again
        # changes nothing)
        skipped = id(optimizer) in self._skip
        self._skip.discard(id(optimizer))
        if self.policy.master_weights:
            mine = casting.ids(self.master_params(optimizer))
            pairs = [(h, m) for h, m in self._pairs if id(m) in mine]
            if pairs and not skipped:
                self._sync_halves(optimizer)
            for _, m in pairs:  # masters' grads were consumed by this step
                m.grad = None

    def _sync_halves(self, optimizer: torch.optim.Optimizer) -> None:
        """O2: copy ``optimizer``'s fp32 masters to the model's half parameters."""
        mine = casting.ids(self.master_params(optimizer))
        pairs = [(h, m) for h, m in self._pairs if id(m) in mine]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([h for h, _ in pairs], [m for _, m in pairs])

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients or loss so far (all optimizers together)."""
        self._settle()
        return self.guard.skipped

    def pending_skips(self) -> set[int]:
        """ids of the optimizers whose next step will be skipped (an inf/NaN was found in their gradients);
        a copy. With :meth:`set_pending_skips`, for code that must step an optimizer aside (a checkpoint
        writer initializing optimizer state) and put the overflow record back."""
        return set(self._skip)

    def set_pending_skips(self, ids: set[int]) -> None:
        """Restore what :meth:`pending_skips` returned."""
        self._skip = set(ids)


class _MasterClosure:
    """An O2 optimizer's closure, run on the half model: the masters' values go to the half parameters before each
    call, and the half gradients it leaves go to the masters after it (accumulated, as ``backward`` does)."""

    def __init__(self, owner: StepChecks, optimizer: torch.optim.Optimizer, closure: Any) -> None:
        self.owner, self.optimizer, self.closure = owner, optimizer, closure

    def __call__(self) -> Any:
        self.owner._sync_halves(self.optimizer)
        loss = self.closure()
        self.owner._flush_pending()
        return loss
