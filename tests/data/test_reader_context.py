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


def test_cpu_pipeline_workers_start_from_a_forkserver_once_cuda_is_initialized(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU pipeline's workers forked from a CUDA process with live threads is what hung the GPU demo's
    loader comparison: they now start as the GPU readers do, and give the batches in-process reading gives."""
    from overdrive.data import ImageLoader, LoaderConfig

    root = write_folder(tmp_path, 8)
    cfg = LoaderConfig(batch_size=4, size=16, seed=3, num_workers=0, pipeline="cpu")
    inline = list(ImageLoader(root, device="cpu", config=cfg))
    seen = []
    real = torch.utils.data.DataLoader.__init__

    def spy(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        seen.append(kw.get("multiprocessing_context"))
        real(self, *a, **kw)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", spy)
    got = list(ImageLoader(root, device="cpu", config=cfg.replace(num_workers=2)))
    assert [c.get_start_method() for c in seen] == ["forkserver"]
    assert len(got) == len(inline) == 2
    for (xa, ya), (xb, yb) in zip(got, inline):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)  # the same seeds give the same crops in any process
