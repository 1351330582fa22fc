"""Views that apex scripts read and write: ``amp._amp_state.loss_scalers[i]`` and ``optimizer._amp_stash``.

Both are views over the :class:`~overdrive.amp.MixedPrecision` that ``amp.initialize`` made, not copies:
setting ``amp._amp_state.loss_scalers[0]._loss_scale = 2**20`` (DeepLearningExamples BERT's initial scale)
sets the scale the next ``scale_loss`` uses, and ``optimizer._amp_stash.all_fp32_from_fp16_params`` are the
fp32 masters the optimizer steps. They hold weak references and pickle to an empty view.

A loss scaler's ``_overflow_buf`` (apex's one-element int overflow flag, which scripts pass to
``multi_tensor_applier`` and read through ``update_scale()``) lives in :class:`OverflowRecord`, one per scaler,
kept in a weak map so the views can be made afresh on each access.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from overdrive.amp.core import MixedPrecision
from overdrive.amp.scaler import LossScaler


class OverflowRecord:
    """What apex kept on its scaler besides the scale: the overflow buffer and whether ``update_scale()`` is due.

    ``buf`` is what ``_overflow_buf`` names (a script may swap in its own, as DeepLearningExamples BERT does for
    its all-reduce); ``scale_loss`` writes what it found into it. ``awaiting_update`` is True after a
    ``scale_loss(..., delay_overflow_check=True)`` until ``update_scale()`` or the next optimizer step updates the
    scale, so a delayed check is never lost.
    """

    def __init__(self, device: torch.device) -> None:
        self.buf = torch.zeros(1, dtype=torch.int32, device=device)
        self.awaiting_update = False


# One record per LossScaler, weakly: it goes with its scaler (and so with its initialize call).
_records: weakref.WeakKeyDictionary[LossScaler, OverflowRecord] = weakref.WeakKeyDictionary()


def overflow_record(scaler: LossScaler, device: torch.device | str = "cpu") -> OverflowRecord:
    """The :class:`OverflowRecord` of ``scaler``, made on ``device`` at the first call."""
    record = _records.get(scaler)
    if record is None:
        record = _records[scaler] = OverflowRecord(torch.device(device))
    return record


class ApexLossScaler:
    """apex.amp.scaler.LossScaler's names over a :class:`LossScaler`.

    ``loss_scale()``, ``_loss_scale`` (read and write), ``cur_scale`` (the FP16_Optimizer/DeepSpeed name,
    read and write), ``dynamic``, ``_unskipped``, ``_max_loss_scale``, ``_min_loss_scale``, ``_scale_seq_len``
    (the growth interval) and ``_has_overflow`` (True when the last update backed off).

    Example:
        >>> view = ApexLossScaler(LossScaler(init_scale=2.0**16))
        >>> view._loss_scale = 2.0**20; view.loss_scale()
        1048576.0
    """

    def __init__(self, scaler: LossScaler) -> None:
        self.scaler = scaler

    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def _loss_scale(self) -> float:
        return self.scaler.scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self.scaler.scale = float(value)

    cur_scale = _loss_scale

    @property
    def dynamic(self) -> bool:
        return self.scaler.dynamic

    @property
    def _unskipped(self) -> int:
        return self.scaler.unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self.scaler.unskipped = int(value)

    @property
    def _has_overflow(self) -> bool:
        return self.scaler.consecutive_skips > 0

    @property
    def _max_loss_scale(self) -> float:
        return self.scaler.max_scale

    @property
    def _min_loss_scale(self) -> float:
        return self.scaler.min_scale

    @property
    def _scale_seq_len(self) -> int:
        return self.scaler.growth_interval

    @property
    def _overflow_buf(self) -> torch.Tensor:
        return overflow_record(self.scaler).buf

    @_overflow_buf.setter
    def _overflow_buf(self, value: torch.Tensor) -> None:
        overflow_record(self.scaler, value.device).buf = value

    def clear_overflow_state(self) -> None:
        """Zero the overflow buffer (apex did at every ``scale_loss``)."""
        overflow_record(self.scaler).buf.zero_()

    def update_scale(self) -> bool:
        """apex's ``LossScaler.update_scale()``: read ``_overflow_buf`` (one host sync), back off on an overflow or
        count a clean step (x2 after the growth interval), and return whether the step should be skipped.

        For a dynamic scale only, as in apex (a static one returns False). The caller skips the step, as in apex;
        a later ``optimizer.step()`` still checks the gradients of a delayed check itself and skips inf/NaN ones.

        Example:
            >>> view = ApexLossScaler(LossScaler(init_scale=2.0**16))
            >>> _ = view._overflow_buf.fill_(1); view.update_scale(), view.loss_scale()
            (True, 32768.0)
        """
        record = overflow_record(self.scaler)
        record.awaiting_update = False
        if not self.scaler.dynamic:
            return False
        found = bool(record.buf.item())
        self.scaler.update(found)
        return found

    def __repr__(self) -> str:
        return f"ApexLossScaler(loss_scale={self.scaler.scale:g}, dynamic={self.scaler.dynamic})"


class AmpState:
    """``amp._amp_state``: ``loss_scalers`` and ``opt_properties``, both of the latest live ``initialize`` call.

    apex replaced ``_amp_state.loss_scalers`` at every ``initialize`` call, so ``loss_scalers[0]`` right after a
    call (DLE BERT and ViT-pytorch set its ``_loss_scale`` there) is that call's first scaler, also while an
    earlier model and optimizer are still alive. ``amp.state_dict()`` covers every live call.
    """

    def __init__(self, live: Callable[[], list[MixedPrecision]]) -> None:
        self._live = live

    @property
    def loss_scalers(self) -> list[ApexLossScaler]:
        """One view per loss (``num_losses``) of the latest live call, in ``loss_id`` order."""
        handles = self._live()
        return [ApexLossScaler(s) for s in handles[-1].scalers] if handles else []

    @property
    def opt_properties(self) -> SimpleNamespace | None:
        handles = self._live()
        if not handles:
            return None
        p = handles[-1].policy
        return SimpleNamespace(
            enabled=True, opt_level=p.opt_level, cast_model_type=p.cast_model_type, patch_torch_functions=p.autocast,
            keep_batchnorm_fp32=p.keep_batchnorm_fp32, master_weights=p.master_weights, loss_scale=p.loss_scale,
        )


class AmpStash:
    """``optimizer._amp_stash``: apex's grouping of the optimizer's parameters.

    ``fp16_groups`` / ``all_fp16_params``: the half model parameters O2 pairs with masters;
    ``fp32_from_fp16_groups`` / ``all_fp32_from_fp16_params``: those masters (what the optimizer steps);
    ``fp32_from_fp32_groups`` / ``all_fp32_from_fp32_params``: the other parameters it steps (fp32 norms
    under O2, everything at O0/O1/O3). One list per param group, read when asked (groups added later count).
    """

    lazy_init_called = True
    already_patched = False
    params_have_scaled_gradients = False

    def __init__(self, handle: MixedPrecision, optimizer: torch.optim.Optimizer) -> None:
        self._handle = weakref.ref(handle)
        self._optimizer = weakref.ref(optimizer)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, _state: dict[str, Any]) -> None:  # a copied optimizer has no amp behind it
        self._handle = self._optimizer = lambda: None  # type: ignore[assignment]

    def _groups(self) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]], list[list[nn.Parameter]]]:
        handle, opt = self._handle(), self._optimizer()
        if handle is None or opt is None:
            return [], [], []
        half_of = {id(m): h for h, m in handle.master_pairs(opt)}
        fp16, from16, fp32 = [], [], []
        for group in opt.param_groups:
            masters = [q for q in group["params"] if id(q) in half_of]
            fp16.append([half_of[id(q)] for q in masters])
            from16.append(masters)
            fp32.append([q for q in group["params"] if id(q) not in half_of])
        return fp16, from16, fp32

    @property
    def fp16_groups(self) -> list[list[nn.Parameter]]:
        return self._groups()[0]

    @property
    def fp32_from_fp16_groups(self) -> list[list[nn.Parameter]]:
        return self._groups()[1]

    @property
    def fp32_from_fp32_groups(self) -> list[list[nn.Parameter]]:
        return self._groups()[2]

    @property
    def all_fp16_params(self) -> list[nn.Parameter]:
        return [q for g in self.fp16_groups for q in g]

    @property
    def all_fp32_from_fp16_params(self) -> list[nn.Parameter]:
        return [q for g in self.fp32_from_fp16_groups for q in g]

    @property
    def all_fp32_from_fp32_params(self) -> list[nn.Parameter]:
        return [q for g in self.fp32_from_fp32_groups for q in g]
