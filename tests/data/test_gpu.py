"""The GPU pipeline (nvJPEG + grid_sample on a side stream) against the CPU pipeline: run with `pytest -m gpu`."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from overdrive.data import ImageLoader
from overdrive.data.decode import decode_cpu, decode_gpu

pytestmark = pytest.mark.gpu


def _collect(loader: ImageLoader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*[(x.float().cpu(), y.cpu()) for x, y in loader])
    return torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("train", [True, False])
def test_gpu_pipeline_matches_cpu_pipeline(folder: Path, train: bool) -> None:
    kw = dict(batch_size=8, size=32, seed=5, train=train, num_workers=0)
    xg, yg = _collect(ImageLoader(folder, device="cuda", pipeline="gpu", **kw))
    xc, yc = _collect(ImageLoader(folder, device="cuda", pipeline="cpu", **kw))
    assert torch.equal(yg, yc)  # same order, same crops drawn
    # nvJPEG and libjpeg differ by a level or two per pixel (IDCT/upsampling): in normalized units
    # (std ~0.225*255) one level is ~0.017; allow a mean of 2 levels and a few outliers
    diff = (xg - xc).abs()
    assert float(diff.mean()) < 0.035 and float(diff.quantile(0.99)) < 0.2


def test_gpu_decode_matches_pillow(folder: Path) -> None:
    datas = [p.read_bytes() for p in sorted(folder.rglob("*.jpg"))]
    imgs, fallback = decode_gpu(datas, torch.device("cuda"))
    assert fallback == 0
    for d, g in zip(datas, imgs):
        c = decode_cpu(d)
        assert g is not None and g.is_cuda and g.shape == c.shape
        assert float((g.cpu().float() - c.float()).abs().mean()) < 2.0


def test_fallback_formats_and_corrupt_files(mixed: Path) -> None:
    loader = ImageLoader(mixed, batch_size=8, size=16, device="cuda", pipeline="gpu", train=False)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        x, y = _collect(loader)
    assert x.shape[0] == 6 and loader.stats.skipped == 2
    assert loader.stats.cpu_fallback >= 3  # png, rgba png, cmyk (+ progressive, truncated, corrupt)
    ref = ImageLoader(mixed, batch_size=8, size=16, device="cpu", pipeline="cpu", train=False, num_workers=0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        xc, yc = _collect(ref)
    assert torch.equal(y, yc) and float((x - xc).abs().mean()) < 0.05


def test_bf16_channels_last_on_device(folder: Path) -> None:
    loader = ImageLoader(folder, batch_size=8, size=24, device="cuda", pipeline="gpu", dtype=torch.bfloat16, channels_last=True)
    x, y = next(iter(loader))
    assert x.is_cuda and y.is_cuda and x.dtype == torch.bfloat16
    assert x.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("read_workers", [0, 2])
def test_early_break_stops_producers(folder: Path, read_workers: int) -> None:
    import multiprocessing as mp

    before = {t.ident for t in threading.enumerate()}
    loader = ImageLoader(folder, batch_size=2, size=8, device="cuda", pipeline="gpu", prefetch=1, read_workers=read_workers)
    for _ in range(3):
        for _x, _y in loader:
            break
    torch.cuda.synchronize()
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
    assert not [p for p in mp.active_children() if p.is_alive()]  # the reader processes are gone too
    assert len(list(loader)) == len(loader)  # and a full epoch still works afterwards


def test_auto_measures_and_says_why(folder: Path) -> None:
    loader = ImageLoader(folder, batch_size=4, size=16, device="cuda", pipeline="auto", num_workers=2)
    assert loader.pipeline in ("cpu", "gpu")
    assert loader.decision and "img/s" in loader.decision and loader.pipeline in loader.decision


def test_all_corrupt_batch_comes_out_empty_on_the_gpu_path(folder: Path) -> None:
    """The GPU path yields an empty batch for all-undecodable files, like the CPU path, so len() holds."""
    for f in sorted(folder.rglob("*.jpg"))[:4]:
        f.write_bytes(b"not an image")
    loader = ImageLoader(folder, batch_size=2, size=16, device="cuda", pipeline="gpu", shuffle=False,
                         channels_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        batches = list(loader)
        cpu = list(ImageLoader(folder, batch_size=2, size=16, device="cpu", pipeline="cpu", shuffle=False,
                               num_workers=0))
    assert len(batches) == len(loader) == len(cpu)
    assert [x.shape[0] for x, _ in batches] == [x.shape[0] for x, _ in cpu]  # same batches emptied as on CPU
    empty = [(x, y) for x, y in batches if x.shape[0] == 0]
    assert empty and all(x.is_cuda and y.is_cuda and x.shape == (0, 3, 16, 16) for x, y in empty)
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x, _ in empty)
    assert loader.stats.skipped == 4


def test_set_epoch_between_iter_and_next_on_the_gpu_path(folder: Path) -> None:
    """The GPU producers draw their crops from the epoch fixed at iter(), not the one set afterwards."""
    loader = ImageLoader(folder, batch_size=8, size=16, device="cuda", pipeline="gpu", seed=3)
    loader.set_epoch(0)
    ref = [x.cpu() for x, _ in loader]
    it = iter(loader)
    loader.set_epoch(1)
    got = [x.cpu() for x, _ in it]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
