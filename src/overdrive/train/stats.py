"""What :meth:`Trainer.fit <overdrive.train.Trainer.fit>` reports: one :class:`EpochStats` per epoch, gathered in a
:class:`FitResult`; and the mean over ranks that makes an epoch-level decision the same on every rank.

Example:
    >>> r = FitResult([EpochStats(0, 1.0, 8, 2.0, 0), EpochStats(1, 0.5, 8, 1.0, 0)])
    >>> r.final_loss, r.samples_per_s
    (0.5, 8.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from overdrive._utils.errors import UsageError


@dataclass
class EpochStats:
    epoch: int
    loss: float  # mean training loss over the epoch
    samples: int
    seconds: float
    skipped_steps: int
    eval_loss: float | None = None
    eval_accuracy: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def mean_over_ranks(value: float, device: torch.device) -> float:
    """``value`` averaged over the ranks of the default process group (itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


@dataclass
class FitResult:
    history: list[EpochStats] = field(default_factory=list)
    peak_memory_mib: float = 0.0
    stopped_epoch: int | None = None  # the epoch after which fit stopped early, None if it ran them all

    @property
    def final_loss(self) -> float:
        if not self.history:
            raise UsageError("this fit ran no epoch (fit(max_epochs=N) with trainer.epoch already at N), so it has no "
                             "final loss; raise max_epochs to train further")
        return self.history[-1].loss

    @property
    def samples_per_s(self) -> float:
        """Throughput over all epochs but the first (warm-up), or over the only one."""
        timed = self.history[1:] or self.history
        return sum(e.samples for e in timed) / max(sum(e.seconds for e in timed), 1e-12)
