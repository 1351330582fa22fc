"""The GPU pipeline's reader processes start from a forkserver once CUDA is initialized in the process: forked
readers inherited CUDA state and died with cudaErrorInitializationError on the H200 when a model had used the
GPU before the loader (seen running the GPU tests in one process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overdrive.data import loader as loader_mod
from overdrive.data.sources import from_folder

from .conftest import write_folder


def test_fork_unless_cuda_is_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert loader_mod.reader_context() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert loader_mod.reader_context().get_start_method() == "forkserver"


def test_readers_from_a_forkserver_read_the_same_bytes(tmp_path: Path) -> None:
    """What the forkserver needs works: the dataset pickles, and readers there give what in-process reading gives."""
    import multiprocessing as mp

    samples, _ = from_folder(write_folder(tmp_path, 6))
    batches = [[0, 1, 2], [3, 4, 5]]
    ds = loader_mod._BytesDataset(samples, batches, [0, 1])
    inline = [ds[i] for i in range(len(ds))]
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=mp.get_context("forkserver"))
    got = list(dl)
    assert len(got) == 2
    for a, b in zip(got, inline):
        assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[6] == b[6]
