"""Saving and resuming :class:`~overdrive.amp.core.MixedPrecision`: the amp state and a half-done accumulation.

:meth:`AmpState.state_dict` holds the loss scaler(s) and O2's fp32 masters, so a resume is bit-identical; it also
reads the ``loss_scaler<i>`` entries NVIDIA apex wrote. :meth:`AmpState.pending_state` holds the gradients of an
accumulation in progress. A mixin of ``MixedPrecision``; the attributes below are set by its ``__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.amp.config import dtype_name
from overdrive.amp.guard import read_flags
from overdrive.amp.steps import LOSS_WHY

if TYPE_CHECKING:
    from collections.abc import Iterator

    from overdrive.amp.config import Policy
    from overdrive.amp.scaler import LossScaler


class AmpState:
    """``state_dict`` / ``load_state_dict`` and ``pending_state`` / ``load_pending_state`` (a mixin of
    ``MixedPrecision``)."""

    # set by MixedPrecision.__init__
    optimizers: list[torch.optim.Optimizer]
    policy: Policy
    scalers: list[LossScaler]
    _pairs: list[tuple[nn.Parameter, nn.Parameter]]
    _skip: set[int]
    _check: set[int]
    _why: dict[int, str]
    _bad_loss: dict[int, torch.Tensor]
    _dev_skip: torch.Tensor | None
    _deferred_why: str | None

    if TYPE_CHECKING:  # MixedPrecision's, used here
        @property
        def scaler(self) -> LossScaler: ...
        def master_params(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[nn.Parameter]: ...
        def _settle(self) -> None: ...
        def _adopt_added_groups(self) -> None: ...

    def _half_dtype(self) -> torch.dtype | None:
        """The half dtype this run computes in (autocast or a cast model); None at O0, where the
        resolved policy still names the device's default but nothing uses it."""
        p = self.policy
        return p.dtype if p.autocast or p.cast_model_type is not None else None

    def state_dict(self) -> dict[str, Any]:
        """Scaler state, plus the fp32 masters under O2 (so a resume is bit-identical)."""
        self._settle()
        self._adopt_added_groups()
        state: dict[str, Any] = {
            "opt_level": self.policy.opt_level,
            "dtype": dtype_name(self._half_dtype()),
            "loss_scaler": self.scaler.state_dict(),
        }
        if self.policy.master_weights:
            state["master_params"] = [m.detach().clone() for _, m in self._pairs]
        if len(self.scalers) > 1:
            state["extra_loss_scalers"] = [s.state_dict() for s in self.scalers[1:]]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, or a ``loss_scaler<i>`` entry written by NVIDIA apex.

        apex's entries hold only ``loss_scale`` and ``unskipped`` (no opt level, dtype or masters:
        apex resumes load the model's weights, which under O2 refresh the masters through the load
        hook). They set a dynamic scaler's scale and clean-step count; a static scale belongs to
        this run's policy (bf16 needs none) and is kept.
        """
        self._settle()
        self._adopt_added_groups()
        if "opt_level" not in state and "loss_scale" in state:  # apex/amp/frontend.py's format
            if self.scaler.dynamic:
                self.scaler.load_state_dict({k: state[k] for k in ("loss_scale", "unskipped") if k in state})
            return
        same_dtype = self._half_dtype() is None or state.get("dtype") == dtype_name(self._half_dtype())
        if state.get("opt_level") != self.policy.opt_level or not same_dtype:
            # A resume at another opt level or half dtype (``--opt-level O1`` after O2, a CUDA fp16 run resumed in
            # bf16 on a CPU): apex loads it, its state being only the loss scale. So here: a dynamic scaler takes
            # the saved scale of a dynamic one; the O2 masters come from the model's weights, loaded beside this.
            # (A run that uses no half dtype, O0, matches any dtype.)
            saved = [state.get("loss_scaler") or {}, *state.get("extra_loss_scalers", [])]
            for scaler, st in zip(self.scalers, saved):
                if scaler.dynamic and st.get("dynamic", True) and "loss_scale" in st and "unskipped" in st:
                    scaler.load_state_dict({k: st[k] for k in ("loss_scale", "unskipped", "overflows") if k in st})
            return
        extra = state.get("extra_loss_scalers", [])
        if len(extra) != len(self.scalers) - 1:
            raise UsageError(f"amp state holds {len(extra) + 1} loss scaler(s) but this run has {len(self.scalers)}; "
                             f"initialize with num_losses={len(extra) + 1}")
        for scaler, saved in zip(self.scalers, [state["loss_scaler"], *extra]):
            scaler.load_state_dict(saved)
        if self.policy.master_weights:
            masters = state.get("master_params")
            if masters is None or len(masters) != len(self._pairs):
                raise UsageError(
                    f"amp state holds {0 if masters is None else len(masters)} master params, this model has "
                    f"{len(self._pairs)}; load a state saved from the same model"
                )
            with torch.no_grad():
                for (half, master), saved in zip(self._pairs, masters):
                    if saved.shape != master.shape:
                        raise UsageError(f"master param shape {tuple(saved.shape)} != {tuple(master.shape)}")
                    master.copy_(saved)
                    half.copy_(master)

    def pending_state(self) -> dict[str, Any]:
        """Gradients accumulated since the last step, and whether that step will be skipped.

        What a checkpoint taken in the middle of gradient accumulation needs besides
        :meth:`state_dict` to resume bit-identically; restore it with :meth:`load_pending_state`.
        ``grads`` follow :meth:`master_params`; ``half_grads`` are O2 model grads from a backward
        outside :meth:`scale_loss` that were not yet moved to the masters.
        """
        self._settle()
        self._adopt_added_groups()

        def clone(g: torch.Tensor | None) -> torch.Tensor | None:
            return None if g is None else g.detach().clone()

        if self._dev_skip is not None and read_flags(self._dev_skip)[0]:  # deferred checks: an overflow found
            self._skip.add(id(self.optimizers[0]))
            if self._deferred_why is not None:
                self._why.setdefault(id(self.optimizers[0]), self._deferred_why)
            self._dev_skip, self._deferred_why = None, None
        why = {i: self._why[id(opt)] for i, opt in enumerate(self.optimizers) if id(opt) in self._why}
        for i, opt in enumerate(self.optimizers):
            flag = self._bad_loss.get(id(opt))
            if flag is not None and bool(flag.item()):  # a checkpoint may sync
                why.setdefault(i, LOSS_WHY)
        return {
            "grads": [clone(q.grad) for q in self.master_params()],
            "half_grads": [clone(h.grad) for h, _ in self._pairs],
            "skip": [i for i, opt in enumerate(self.optimizers) if id(opt) in self._skip],
            "check": [i for i, opt in enumerate(self.optimizers) if id(opt) in self._check],
            "nonfinite": why,  # optimizer index -> what its next step will be skipped for (not a routine backoff)
        }

    def load_pending_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`pending_state` saved (after the model, optimizer and amp state)."""
        self._settle()
        self._adopt_added_groups()
        for key, params in (("grads", list(self.master_params())), ("half_grads", [h for h, _ in self._pairs])):
            saved = state.get(key)
            if saved is None or len(saved) != len(params):
                raise UsageError(
                    f"pending gradient state has {0 if saved is None else len(saved)} {key!r}, this run has "
                    f"{len(params)} parameters; load a state saved from the same model and optimizer"
                )
            for q, g in zip(params, saved):
                if g is not None and g.shape != q.shape:
                    raise UsageError(f"pending gradient of shape {tuple(g.shape)} != parameter shape {tuple(q.shape)}")
                q.grad = None if g is None else g.to(device=q.device, dtype=q.dtype, copy=True)
        self._skip = {id(self.optimizers[i]) for i in state.get("skip", [])}
        self._check = {id(self.optimizers[i]) for i in state.get("check", [])}
        self._why = {id(self.optimizers[int(i)]): str(w) for i, w in state.get("nonfinite", {}).items()}
        self._bad_loss = {}
