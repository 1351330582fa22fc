"""ImageLoader leaves the process's intra-op thread count (torch.get_num_threads()) as the caller set it: between
batches, after an epoch, after an early break or an error; worker processes never set it in the caller."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from overdrive.data import ImageLoader
from overdrive.data import loader as loader_mod


@pytest.fixture
def unusual_threads() -> Iterator[int]:
    """A thread count nobody's default gives (the default is the core count); put back after."""
    before = torch.get_num_threads()
    n = before + 1
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(before)


def test_in_process_batches_leave_the_thread_count_alone(folder: Path, unusual_threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    inside: list[int] = []
    real = loader_mod.transform_batch  # size 8: the batch is transformed at once (BATCHED_CPU_MAX_SIZE)

    def noting(*args, **kwargs):  # the transform runs on one thread, for speed, and only inside the batch
        inside.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(loader_mod, "transform_batch", noting)
    loader = ImageLoader(folder, batch_size=5, size=8, num_workers=0)
    between = [torch.get_num_threads() for _ in loader]
    assert len(between) == len(loader) and set(between) == {unusual_threads}
    assert torch.get_num_threads() == unusual_threads
    assert set(inside) == {1}
    for _ in loader:  # an early break
        break
    assert torch.get_num_threads() == unusual_threads


def test_an_error_inside_a_batch_restores_the_thread_count(folder: Path, unusual_threads: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("transform failed")

    monkeypatch.setattr(loader_mod, "transform_batch", broken)
    with pytest.raises(RuntimeError, match="transform failed"):
        next(iter(ImageLoader(folder, batch_size=5, size=8, num_workers=0)))
    assert torch.get_num_threads() == unusual_threads


def test_worker_processes_do_not_set_the_callers_thread_count(folder: Path, unusual_threads: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []  # filled in this process only: forked workers append to their own copy
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n))[1])
    batches = list(ImageLoader(folder, batch_size=5, size=8, num_workers=2))
    assert len(batches) == 5 and calls == [] and torch.get_num_threads() == unusual_threads
