"""Which samples each rank sees in an epoch, and in which batches: DistributedSampler semantics from a seed and the
epoch alone, so every rank agrees without communicating (``ImageLoader`` and its workers use these)."""

from __future__ import annotations

import math
import os

import torch

from overdrive.data.config import LoaderConfig


def rank_and_world() -> tuple[int, int] | None:
    """(rank, world size) from an initialized process group, else from torchrun's RANK / WORLD_SIZE; None outside."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):  # not under a launcher, or values init() will name
        return None
    return (rank, world) if 0 <= rank < world else None


def shard_indices(n: int, epoch: int, seed: int, shard_id: int, num_shards: int, drop_last: bool,
                  shuffle: bool = True) -> list[int]:
    """This shard's sample indices for ``epoch`` (DistributedSampler semantics).

    The permutation depends on (seed, epoch) only, so every rank agrees on it. ``drop_last``
    trims it to a multiple of ``num_shards``; otherwise it is padded by wrapping around, so every
    rank gets the same count and each sample is seen once per epoch (plus at most num_shards-1 repeats).

    Example:
        >>> sorted(shard_indices(5, 0, 0, 0, 2, False) + shard_indices(5, 0, 0, 1, 2, False))[:5]
        [0, 1, 2, 3, 4]
    """
    if shuffle:  # the key folded into the generator's 64-bit range: any int seed works (time_ns() too)
        key = (seed * 1_000_003 + epoch) % (2**63 - 1)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(key)).tolist()
    else:
        perm = list(range(n))
    if drop_last:
        perm = perm[: (n // num_shards) * num_shards]
    else:
        total = math.ceil(n / num_shards) * num_shards
        while len(perm) < total:
            perm += perm[: total - len(perm)]
    return perm[shard_id::num_shards]


def epoch_batches(n: int, shuffle: bool, cfg: LoaderConfig, epoch: int) -> list[list[int]]:
    """The sample indices of each batch of ``epoch`` on this shard (``cfg``'s seed, shard, batch size, drop_last).

    Example:
        >>> epoch_batches(10, False, LoaderConfig(batch_size=4), 0)
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """
    idx = shard_indices(n, epoch, cfg.seed, cfg.shard_id, cfg.num_shards, cfg.drop_last, shuffle)
    bs = cfg.batch_size
    count = len(idx) // bs if cfg.drop_last else math.ceil(len(idx) / bs)
    return [idx[k * bs:(k + 1) * bs] for k in range(count)]
