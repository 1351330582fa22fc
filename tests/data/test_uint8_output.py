"""``dtype=torch.uint8``: batches of the cropped, resized and flipped pixels themselves, rounded to 0-255 and not
normalized (DALI's ``crop_mirror_normalize(dtype=types.UINT8)`` without mean/std), on every path: the batched CPU
transform (outputs up to 64 px), the per-image one, and the GPU pipeline's ``transform_batch`` (run here on CPU
tensors; the loader on CUDA in ``test_gpu.py``'s style below). Reference: the float32 loader's batches with the
normalization undone, in pixel units; uint8 is their rounding, so within 0.5 level (+ float32 rounding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.data import ImageLoader, LoaderConfig
from overdrive.data.config import IMAGENET_MEAN, IMAGENET_STD
from overdrive.data.loader import empty_batch
from overdrive.data.transforms import draw_params, reference_batch, transform_batch


def _pixels(x: torch.Tensor) -> torch.Tensor:
    """A float32 loader batch back in [0, 255] pixel units."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    return x.double() * std.double() + mean.double()


@pytest.mark.parametrize("size", [16, 80])  # the batched CPU transform (<= 64 px) and the per-image one
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_uint8_batches_are_the_float_batches_pixels_rounded(folder: Path, size: int, train: bool,
                                                            channels_last: bool) -> None:
    kw = dict(batch_size=8, size=size, seed=4, train=train, num_workers=0, pipeline="cpu", channels_last=channels_last)
    floats = list(ImageLoader(folder, **kw))
    ints = list(ImageLoader(folder, dtype=torch.uint8, **kw))
    assert len(ints) == len(floats) == 3
    for (xf, yf), (xi, yi) in zip(floats, ints):
        assert xi.dtype == torch.uint8 and xi.shape == xf.shape == (len(yf), 3, size, size)
        assert xi.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        assert torch.equal(yi, yf)
        err = (xi.double() - _pixels(xf)).abs()
        assert float(err.max()) <= 0.5 + 1e-3  # rounded, not truncated (a plain cast is off by up to 1 level)


def test_uint8_name_and_json_round_trip() -> None:
    cfg = LoaderConfig(dtype="uint8", size=32)
    assert cfg.dtype == torch.uint8
    assert LoaderConfig.from_json(cfg.to_json()) == cfg
    assert empty_batch(cfg).dtype == torch.uint8


def test_gpu_transform_gives_uint8_too() -> None:
    """The GPU pipeline's batched gather-and-blend (the same code on CUDA tensors), against the reference path."""
    g = torch.Generator().manual_seed(0)
    imgs = [torch.randint(0, 256, (3, 30 + 5 * i, 41 - 3 * i), dtype=torch.uint8, generator=g) for i in range(5)]
    u, flips = draw_params(5, torch.Generator().manual_seed(1), 0.5)
    for train in (True, False):
        cfg = LoaderConfig(size=24, train=train, dtype=torch.uint8)
        out = transform_batch(imgs, u, flips, cfg)
        ref = reference_batch(imgs, u, flips, cfg)
        assert out.dtype == ref.dtype == torch.uint8
        # the two paths agree to ~1e-4 in float (test_transforms.py); rounding may fall either side of a .5
        assert int((out.int() - ref.int()).abs().max()) <= 1
        assert float((out != ref).float().mean()) < 0.01


@pytest.mark.parametrize("kw", [dict(mean=(0.5, 0.5, 0.5)), dict(std=(0.5, 0.5, 0.5)),
                                dict(mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))])
def test_uint8_with_mean_or_std_is_refused(folder: Path, kw: dict) -> None:
    with pytest.raises(UsageError, match=r"cannot apply to dtype=torch.uint8.*normalize on the device"):
        ImageLoader(folder, dtype=torch.uint8, num_workers=0, **kw)


def test_other_integer_dtypes_are_refused_naming_uint8() -> None:
    with pytest.raises(UsageError, match=r"dtype=torch.int32 is not supported.*torch.uint8"):
        LoaderConfig(dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pipeline_uint8_matches_cpu_pipeline(folder: Path) -> None:
    kw = dict(batch_size=8, size=32, seed=5, num_workers=0, dtype=torch.uint8)
    g = [(x.cpu(), y.cpu()) for x, y in ImageLoader(folder, device="cuda", pipeline="gpu", **kw)]
    c = [(x.cpu(), y.cpu()) for x, y in ImageLoader(folder, device="cuda", pipeline="cpu", **kw)]
    for (xg, yg), (xc, yc) in zip(g, c):
        assert xg.dtype == xc.dtype == torch.uint8 and torch.equal(yg, yc)
        # nvJPEG and libjpeg differ by a level or two per pixel (see test_gpu.py)
        assert float((xg.float() - xc.float()).abs().mean()) < 2.0
