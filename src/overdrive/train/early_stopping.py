"""Early stopping for :meth:`Trainer.fit <overdrive.train.Trainer.fit>`, with Keras' and Lightning's knobs.

``fit(..., early_stopping=EarlyStopping(monitor="eval_loss", patience=3))`` ends training once the monitored
value has not improved by more than ``min_delta`` for ``patience`` epochs in a row. Under
``strategy="ddp"|"fsdp"`` fit hands it the value averaged over ranks, so every rank decides alike and stops at the
same epoch (a rank that stopped alone left the others waiting in a collective).

Example:
    >>> es = EarlyStopping(monitor="loss", patience=2)
    >>> [es.step(v) for v in (1.0, 0.8, 0.85, 0.81)]
    [False, False, False, True]
    >>> es.best, es.best_epoch
    (0.8, 1)
"""

from __future__ import annotations

import math
from typing import Any

from overdrive._utils.errors import UsageError

MONITORS = ("loss", "eval_loss", "eval_accuracy")  # the EpochStats fields a stop can watch


class EarlyStopping:
    """Stop when ``monitor`` (an :class:`~overdrive.train.EpochStats` field: "loss", "eval_loss" or
    "eval_accuracy") has not improved for ``patience`` epochs.

    - ``min_delta``: an improvement must beat the best value by more than this (>= 0).
    - ``mode``: "min" (losses), "max" (accuracy) or "auto" ("max" for "eval_accuracy", else "min").
    - ``patience``: epochs without improvement before stopping (0: stop at the first one that does not improve).

    An inf/NaN value counts as no improvement. The state (``best``, ``wait``, ``best_epoch``) carries over from
    one ``fit`` call to the next; save it with :meth:`state_dict` (e.g. in ``save_checkpoint``'s ``extra``) to resume it.

    Example:
        >>> es = EarlyStopping(monitor="eval_accuracy", patience=1, min_delta=0.01)
        >>> es.mode, [es.step(v) for v in (0.50, 0.505, 0.70, 0.70)]
        ('max', [False, True, False, True])
    """

    def __init__(self, monitor: str = "eval_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "auto") -> None:
        if monitor not in MONITORS:
            raise UsageError(f"EarlyStopping(monitor={monitor!r}): monitor one of {', '.join(map(repr, MONITORS))} "
                             "(the EpochStats fields fit fills)")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise UsageError(f"EarlyStopping(patience={patience!r}) must be an int >= 0 (epochs without improvement "
                             "before stopping)")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not math.isfinite(min_delta) \
                or min_delta < 0:
            raise UsageError(f"EarlyStopping(min_delta={min_delta!r}) must be a finite number >= 0 (the least change "
                             "that counts as an improvement)")
        if mode not in ("min", "max", "auto"):
            raise UsageError(f"EarlyStopping(mode={mode!r}) must be 'min' (lower is better), 'max' or 'auto'")
        self.monitor, self.patience, self.min_delta = monitor, patience, float(min_delta)
        self.mode = ("max" if monitor == "eval_accuracy" else "min") if mode == "auto" else mode
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.wait = 0  # epochs since the last improvement
        self._seen = 0  # values stepped on (the epoch index when step is given none)

    def __repr__(self) -> str:
        return (f"EarlyStopping(monitor={self.monitor!r}, patience={self.patience}, min_delta={self.min_delta}, "
                f"mode={self.mode!r}, best={self.best}, wait={self.wait})")

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def step(self, value: float, epoch: int | None = None) -> bool:
        """Record one epoch's ``value``; True when training should stop."""
        epoch = self._seen if epoch is None else epoch
        self._seen = epoch + 1
        if self.improved(value):
            self.best, self.best_epoch, self.wait = float(value), epoch, 0
            return False
        self.wait += 1
        return self.wait >= self.patience  # Keras' and Lightning's count: patience=2 stops at the 2nd flat epoch

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "best": self.best, "best_epoch": self.best_epoch, "wait": self.wait,
                "seen": self._seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("monitor") != self.monitor:
            raise UsageError(f"the early-stopping state monitors {state.get('monitor')!r}, this EarlyStopping "
                             f"{self.monitor!r}; build it with monitor={state.get('monitor')!r}")
        self.best, self.best_epoch, self.wait, self._seen = state["best"], state["best_epoch"], state["wait"], state["seen"]
