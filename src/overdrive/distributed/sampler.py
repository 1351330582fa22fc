"""A distributed sampler that can stop and resume mid-epoch, also on a different number of ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from overdrive._utils.errors import UsageError


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Shuffles ``n`` indices per epoch (seeded by ``seed + epoch``), deals them round-robin to
    ranks, and counts the *global* samples consumed, so a resume with another world size starts
    at the same place in the epoch. Drops the tail that does not fill a global batch.

    ``batch_size`` is per rank: one global step consumes ``batch_size * world_size`` indices.

    Example:
        >>> s = ResumableSampler(10, batch_size=2, rank=0, world_size=2, shuffle=False)
        >>> list(s)
        [0, 2, 4, 6]
        >>> s.advance(1); list(s)   # after one global step (4 samples) the rank resumes at index 4
        [4, 6]
    """

    def __init__(self, n: int, batch_size: int, rank: int = 0, world_size: int = 1, shuffle: bool = True, seed: int = 0) -> None:
        if n < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise UsageError(f"ResumableSampler(n={n}, batch_size={batch_size}, rank={rank}, world_size={world_size}): "
                             "need n, batch_size, world_size >= 1 and 0 <= rank < world_size")
        if n < batch_size * world_size:  # steps_per_epoch() would be 0: every epoch silently empty
            fix = (f"lower batch_size to at most {n // world_size}" if n >= world_size
                   else f"use at most {n} rank(s), or a larger dataset")
            raise UsageError(f"ResumableSampler(n={n}, batch_size={batch_size}, world_size={world_size}): one global "
                             f"step takes batch_size * world_size = {batch_size * world_size} samples, more than the "
                             f"dataset's {n}, so every epoch would be empty; {fix}")
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.consumed = 0  # global samples of this epoch already trained on

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def steps_per_epoch(self) -> int:
        return self.n // self.global_batch

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def advance(self, steps: int = 1) -> None:
        """Record ``steps`` global batches as consumed: call after each batch trained on (each micro-batch under
        gradient accumulation). :meth:`overdrive.train.Trainer.fit` calls it itself; a hand-written loop does."""
        self.consumed += steps * self.global_batch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        usable = self.steps_per_epoch() * self.global_batch
        return iter(order[self.consumed + self.rank:usable:self.world_size])

    def __len__(self) -> int:
        return max(0, self.steps_per_epoch() * self.global_batch - self.consumed) // self.world_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["n"]) != self.n:
            raise UsageError(f"sampler state is for a dataset of {state['n']} samples, this one has {self.n}")
        consumed = int(state["consumed"])
        if consumed % self.global_batch:
            raise UsageError(f"resumed at sample {consumed}, not a multiple of the global batch {self.global_batch}; "
                             "keep batch_size * world_size dividing the position (change batch_size with world_size)")
        self.epoch, self.consumed, self.seed = int(state["epoch"]), consumed, int(state["seed"])
