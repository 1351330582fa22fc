"""Loss scaling: apex's dynamic scaler (x2 after N clean steps, x0.5 and skip on inf/NaN)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.amp.guard import found_nonfinite


DEFAULT_MIN_SCALE = 1.0  # a dynamic scale backs off no lower than this unless min_scale says otherwise
WARN_AFTER_SKIPS = 50  # consecutive skipped steps before the scaler says training is not progressing


class LossScaler:
    """Dynamic or static loss scale, with state that restores exactly.

    The scale lives on the host (as in apex): an overflow check costs one device sync per
    backward, and only when the scale is dynamic. A static scale (1.0 for bf16) checks nothing here:
    :class:`~overdrive.amp.MixedPrecision` checks those gradients once per optimizer step.
    A dynamic scale never backs off below ``min_scale`` (default 1.0, or ``init_scale`` if that is
    lower): past that, gradients that overflow are not a scaling problem, and halving the scale
    for ever only hides it (it used to fall to 1e-10 and end in an overflow error). After
    ``warn_after`` consecutive skipped steps a RuntimeWarning says so, once per run of skips (None: never;
    :class:`~overdrive.amp.MixedPrecision` passes None, its step guard warns and stops the run instead).

    Example:
        >>> s = LossScaler(dynamic=True, init_scale=2.0**16, growth_interval=2)
        >>> s.update(found_inf=False); s.update(found_inf=False); s.scale
        131072.0
        >>> s.update(found_inf=True); s.scale
        65536.0
    """

    def __init__(
        self,
        dynamic: bool = True,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = None,
        max_scale: float = 2.0**24,
        warn_after: int | None = WARN_AFTER_SKIPS,
    ) -> None:
        self.dynamic = dynamic
        self.scale = float(min(init_scale, max_scale)) if dynamic else float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale if min_scale is not None else min(DEFAULT_MIN_SCALE, float(init_scale))
        self.max_scale = max_scale
        self.warn_after = warn_after
        self.unskipped = 0  # clean steps since the last change (apex's name)
        self.overflows = 0  # total skipped steps, for reporting
        self.consecutive_skips = 0

    def unscale_(self, grads: Sequence[torch.Tensor]) -> bool:
        """Multiply ``grads`` by 1/scale in place; return True when any is inf or NaN.

        With a static scale the finiteness check is skipped here (no device sync); the optimizer step
        checks (:mod:`overdrive.amp.guard`).
        """
        found = self.unscale_and_check_(grads)
        return found is not None and bool(found.item() > 0)

    def unscale_and_check_(self, grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """:meth:`unscale_` without the host sync: the inf/NaN flag as a (1,) device tensor (> 0: found),
        for a caller that reads it together with other flags. None when nothing was checked (a static scale,
        or no gradients)."""
        if not grads:
            return None
        if not self.dynamic:
            if self.scale != 1.0:
                torch._foreach_mul_(list(grads), 1.0 / self.scale)
            return None
        return found_nonfinite(grads, 1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        """Back off on overflow (and count a skipped step); grow after ``growth_interval`` clean steps."""
        if not self.dynamic:
            return
        if found_inf:
            self.overflows += 1
            self.unskipped = 0
            self.consecutive_skips += 1
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            if self.consecutive_skips == self.warn_after:
                warnings.warn(
                    f"{self.consecutive_skips} optimizer steps in a row were skipped for inf/NaN gradients (loss scale "
                    f"now {self.scale:g}, floor {self.min_scale:g}): the gradients overflow at any scale, so training "
                    "is not progressing; lower the learning rate, check the data and the loss for inf/NaN, or train "
                    "at O0/bf16 to find the layer", RuntimeWarning, stacklevel=3)
            return
        self.consecutive_skips = 0
        self.unskipped += 1
        if self.unskipped >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.unskipped = 0

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.scale, "unskipped": self.unskipped, "overflows": self.overflows,
                "dynamic": self.dynamic}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loss_scale" not in state or "unskipped" not in state:
            raise UsageError(f"loss-scaler state has keys {sorted(state)}; expected 'loss_scale' and 'unskipped'")
        if "dynamic" in state and bool(state["dynamic"]) != self.dynamic:
            raise UsageError(
                f"loss-scaler state is {'dynamic' if state['dynamic'] else 'static'} but this run's scaler is "
                f"{'dynamic' if self.dynamic else 'static'}; initialize with the same loss_scale setting"
            )
        self.scale = float(state["loss_scale"])
        self.unskipped = int(state["unskipped"])
        self.overflows = int(state.get("overflows", 0))

