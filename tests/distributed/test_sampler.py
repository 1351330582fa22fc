"""ResumableSampler on datasets smaller than one global batch: a one-line error, not silently empty epochs."""

from __future__ import annotations

import pytest

from overdrive._utils.errors import UsageError
from overdrive.distributed import ResumableSampler


@pytest.mark.parametrize(("n", "batch_size", "world_size", "fix"), [
    (7, 4, 2, "at most 3"),  # 8 samples a global step, 7 in the dataset
    (3, 1, 4, "at most 3 rank"),  # fewer samples than ranks: no batch size fits
])
def test_a_dataset_smaller_than_one_global_batch_is_refused(n: int, batch_size: int, world_size: int, fix: str) -> None:
    with pytest.raises(UsageError, match=fix) as info:
        ResumableSampler(n, batch_size, rank=0, world_size=world_size)
    assert f"n={n}" in str(info.value) and str(batch_size * world_size) in str(info.value)


@pytest.mark.parametrize(("n", "batch_size", "world_size"), [(8, 4, 2), (9, 4, 2), (3, 1, 3)])
def test_one_global_batch_or_more_is_kept(n: int, batch_size: int, world_size: int) -> None:
    samplers = [ResumableSampler(n, batch_size, r, world_size, shuffle=False) for r in range(world_size)]
    assert [len(s) for s in samplers] == [batch_size * (n // (batch_size * world_size))] * world_size
    assert sorted(i for s in samplers for i in s) == list(range(batch_size * world_size * (n // (batch_size * world_size))))
