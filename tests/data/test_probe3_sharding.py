"""Sharding across ranks: every sample once per epoch, reruns agree, set_epoch reshuffles, and a loader left
unsharded on one rank of several is named.

Before: under torchrun (RANK / WORLD_SIZE set, or a process group initialized) a loader built without
shard_id / num_shards read the whole dataset on every rank, in the same order, with no word.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from overdrive.data import ImageLoader, shard_indices
from overdrive.distributed import ResumableSampler
from tests.data.conftest import write_folder


@pytest.mark.parametrize("n", [1, 7, 22, 23])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch(n: int, world: int, drop_last: bool) -> None:
    for epoch in (0, 1):
        shards = [shard_indices(n, epoch, 5, r, world, drop_last) for r in range(world)]
        assert len({len(s) for s in shards}) == 1  # every rank the same count: the same step count
        seen = Counter(i for s in shards for i in s)
        if drop_last:  # n % world dropped, nothing repeated
            assert sum(seen.values()) == n - n % world and max(seen.values(), default=1) == 1
        else:  # all of them, padded by wrapping around (as DistributedSampler)
            assert set(seen) == set(range(n)) and sum(seen.values()) == -(-n // world) * world
        assert shards == [shard_indices(n, epoch, 5, r, world, drop_last) for r in range(world)]  # a rerun agrees
    if n > 3:
        assert shard_indices(n, 0, 5, 0, 1, False) != shard_indices(n, 1, 5, 0, 1, False)  # set_epoch reshuffles


@pytest.mark.parametrize("n", [8, 23])
def test_resumable_sampler_every_sample_at_most_once(n: int) -> None:
    for world in (1, 2, 3):
        parts = [list(ResumableSampler(n, batch_size=2, rank=r, world_size=world, seed=1)) for r in range(world)]
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == (n // (2 * world)) * 2 * world


def _labels(loader: ImageLoader) -> list[int]:
    return [int(v) for _, y in loader for v in y]


def test_two_shards_cover_the_epoch_once(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "imgs", 7, sizes=(16, 20))
    opts = dict(batch_size=2, size=8, num_workers=0, pipeline="cpu", seed=3, num_shards=2)
    full = ImageLoader(root, shuffle=False, **{**opts, "num_shards": 1})
    labels = _labels(full)
    parts = [ImageLoader(root, shard_id=r, **opts) for r in range(2)]
    got = [_labels(p) for p in parts]
    assert len(got[0]) == len(got[1]) == 4 and Counter(got[0] + got[1]) - Counter(labels) == Counter(
        {labels[shard_indices(7, 0, 3, 0, 2, False)[0]]: 1})  # one padded repeat: the permutation's first sample


def test_an_unsharded_loader_on_one_of_several_ranks_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_folder(tmp_path / "imgs", 4, sizes=(16, 20))
    opts = dict(batch_size=2, size=8, num_workers=0, pipeline="cpu")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(RuntimeWarning, match=r"rank 1 of 2 and the loader has num_shards=1.*shard_id=rank"):
        ImageLoader(root, **opts)
    with pytest.warns(RuntimeWarning, match=r"shard_id=0 with num_shards=2 on rank 1 of 2.*not LOCAL_RANK"):
        ImageLoader(root, shard_id=0, num_shards=2, **opts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ImageLoader(root, shard_id=1, num_shards=2, **opts)  # sharded by rank
        ImageLoader(root, shuffle=False, **opts)  # every rank evaluates everything: meant
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    # an initialized process group is read first (what DistributedSampler reads)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    with pytest.warns(RuntimeWarning, match=r"rank 0 of 4 and the loader has num_shards=1"):
        ImageLoader(root, **opts)
