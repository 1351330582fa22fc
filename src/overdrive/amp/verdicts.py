"""Deferred inf/NaN verdicts (:meth:`overdrive.amp.MixedPrecision.defer_checks`): each backward's or step's flags
go to the host behind a CUDA event (pinned memory, no wait) and are read a step later, in order.

Example:
    >>> q = VerdictQueue()
    >>> q.push("backward", torch.ones(1), None, None, at_floor=False)
    >>> [(v.kind, grad, loss, skip) for v, (grad, loss, skip) in q.drain()]
    [('backward', True, False, False)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


@dataclasses.dataclass
class Verdict:
    """One backward's or one step's inf/NaN flags (gradients, loss, step skipped) on their way to the host."""

    kind: str  # "backward", "step" (a dynamic scale's step) or "static" (a static scale's step, checked there)
    values: torch.Tensor  # (3,) on the host (pinned, filled by a copy that ``event`` marks) or on the CPU
    event: Any  # torch.cuda.Event, or None
    at_floor: bool = False  # the backward ran at the loss scale floor
    number: int | None = None  # the step's number in the caller's loop, for messages


class VerdictQueue:
    """Verdicts not yet read, oldest first."""

    def __init__(self) -> None:
        self._items: list[Verdict] = []

    def __bool__(self) -> bool:
        return bool(self._items)

    def push(self, kind: str, grad_flag: torch.Tensor | None, loss_flag: torch.Tensor | None,
             skip: torch.Tensor | None, **fields: Any) -> None:
        """Queue the flags (None: not set); on CUDA they are copied to pinned memory without waiting."""
        present = [f for f in (grad_flag, loss_flag, skip) if f is not None]
        if not present:
            self._items.append(Verdict(kind, torch.zeros(3), None, **fields))
            return
        device = present[0].device
        zero = torch.zeros((), device=device)
        flags = torch.stack([zero if f is None else f.reshape(()).to(device, torch.float32)
                             for f in (grad_flag, loss_flag, skip)])
        if device.type != "cuda":
            self._items.append(Verdict(kind, flags, None, **fields))
            return
        host = torch.empty(3, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._items.append(Verdict(kind, host, event, **fields))

    def drain(self) -> Iterator[tuple[Verdict, tuple[bool, bool, bool]]]:
        """Each verdict with its (gradients bad, loss bad, step skipped), oldest first, removed as it is read (one
        that raises in the caller's handling is not read again)."""
        while self._items:
            v = self._items.pop(0)
            if v.event is not None:
                v.event.synchronize()  # only the work up to this verdict's flags; later work runs on
            grad_bad, loss_bad, skip = (x > 0 for x in v.values.tolist())
            yield v, (grad_bad, loss_bad, skip)


def any_flag(*flags: torch.Tensor | None) -> torch.Tensor | None:
    """1.0 where any flag is set (> 0 or True), else 0.0: a 0-d float32 on the first flag's device, or None when all
    are None. Exactly 1.0: torch's fused optimizers skip a step only when ``found_inf == 1``.

    Example:
        >>> any_flag(torch.tensor(2.0), None, torch.tensor(False)).item()
        1.0
    """
    present = [f for f in flags if f is not None]
    if not present:
        return None
    total = present[0].reshape(()).float()
    for f in present[1:]:
        total = total + f.reshape(()).float().to(total.device)
    return (total > 0).float()
