"""Per-sample crop math: the batched grid_sample path against the per-sample interpolate reference."""

from __future__ import annotations

import math

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.data.config import PRESETS, LoaderConfig
from overdrive.data.transforms import (
    batch_generator,
    draw_params,
    reference_batch,
    rrc_boxes,
    transform_batch,
)


def _images(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hw = torch.randint(17, 120, (n, 2), generator=g)
    return [torch.randint(0, 256, (3, int(h), int(w)), dtype=torch.uint8, generator=g) for h, w in hw]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("size", [16, 37, 64])
def test_grid_path_matches_reference(train: bool, size: int) -> None:
    imgs = _images(24)
    cfg = LoaderConfig(size=size, train=train)
    u, flips = draw_params(len(imgs), batch_generator(0, 0, 0, 0), 0.5)
    got = transform_batch(imgs, u, flips, cfg)
    ref = reference_batch(imgs, u, flips, cfg)
    assert got.shape == (24, 3, size, size)
    # same sampling points, float32 bilinear both ways: only rounding differs (values are ~[-2.1, 2.6])
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)


def test_reference_against_independent_crop_and_resize() -> None:
    """The reference is crop + interpolate + flip + normalize, checked here without shared helpers."""
    img = _images(1, seed=3)[0]
    cfg = LoaderConfig(size=20)
    u, flips = draw_params(1, torch.Generator().manual_seed(5), 1.0)  # flip for sure
    t, l, h, w = rrc_boxes(torch.tensor([[img.shape[1], img.shape[2]]]), u, cfg.scale, cfg.ratio)[0].tolist()
    crop = img[:, t:t + h, l:l + w].double().unsqueeze(0)
    want = torch.nn.functional.interpolate(crop, size=(20, 20), mode="bilinear", align_corners=False)[0].flip(-1)
    mean = torch.tensor(cfg.mean, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(cfg.std, dtype=torch.float64).view(3, 1, 1)
    want = (want / 255 - mean) / std
    got = transform_batch([img], u, flips, cfg)[0].double()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_each_sample_gets_its_own_crop() -> None:
    img = _images(1)[0]
    imgs = [img] * 16  # the same image 16 times: outputs differ only if the crops differ
    u, flips = draw_params(16, torch.Generator().manual_seed(0), 0.5)
    out = transform_batch(imgs, u, flips, LoaderConfig(size=24))
    flat = out.flatten(1)
    dist = torch.cdist(flat, flat)
    off_diag = dist[~torch.eye(16, dtype=torch.bool)]
    assert off_diag.min() > 1.0, "two samples got the same crop"
    assert 2 <= int(flips.sum()) <= 14


def test_rrc_box_statistics() -> None:
    n = 4000
    hw = torch.tensor([[375, 500]]).expand(n, 2)
    u, _ = draw_params(n, torch.Generator().manual_seed(1), 0.5)
    box = rrc_boxes(hw, u, (0.08, 1.0), (3 / 4, 4 / 3)).double()
    t, l, h, w = box.unbind(1)
    assert bool((t >= 0).all() and (l >= 0).all() and (t + h <= 375).all() and (l + w <= 500).all())
    area = h * w / (375 * 500)
    assert area.min() >= 0.075 and area.max() <= 1.0
    aspect = w / h
    assert aspect.min() > 0.72 and aspect.max() < 1.39  # 3/4 .. 4/3 up to rounding to whole pixels
    assert 0.35 < float(area.mean()) < 0.56  # U(0.08, 1) has mean 0.54; large tries that do not fit are redrawn


def _torchvision_rule(H: int, W: int, u: torch.Tensor, scale: tuple, ratio: tuple) -> list[int]:
    """torchvision's RandomResizedCrop.get_params written as its plain loop, fed the same uniforms."""
    for t in range(10):
        area = H * W * (scale[0] + (scale[1] - scale[0]) * float(u[t, 0]))
        lo, hi = math.log(ratio[0]), math.log(ratio[1])
        aspect = math.exp(lo + (hi - lo) * float(u[t, 1]))
        w = int(round(math.sqrt(area * aspect)))
        h = int(round(math.sqrt(area / aspect)))
        if 0 < w <= W and 0 < h <= H:
            return [int(float(u[t, 2]) * (H - h + 1)), int(float(u[t, 3]) * (W - w + 1)), h, w]
    in_ratio = W / H
    if in_ratio < ratio[0]:
        w, h = W, int(round(W / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = H, int(round(H * ratio[1]))
    else:
        w, h = W, H
    return [(H - h) // 2, (W - w) // 2, h, w]


def test_rrc_boxes_equal_the_plain_loop() -> None:
    g = torch.Generator().manual_seed(2)
    hw = torch.randint(5, 300, (300, 2), generator=g)
    hw[:20, 0] = 3  # very flat images exercise the fallback
    u, _ = draw_params(300, g, 0.5)
    for scale in [(0.08, 1.0), (0.9, 1.0)]:
        box = rrc_boxes(hw, u, scale, (3 / 4, 4 / 3)).tolist()
        want = [_torchvision_rule(int(h), int(w), u[i], scale, (3 / 4, 4 / 3)) for i, (h, w) in enumerate(hw.tolist())]
        assert box == want


def test_rrc_fallback_is_center_crop_with_clamped_ratio() -> None:
    u = torch.zeros(1, 10, 4, dtype=torch.float64)
    u[..., 0] = 1.0  # area = whole image every try, log-ratio at its low end: never fits a 10x100 image
    box = rrc_boxes(torch.tensor([[10, 100]]), u, (1.0, 1.0), (3 / 4, 4 / 3))[0].tolist()
    h, w = 10, round(10 * 4 / 3)
    assert box == [0, (100 - w) // 2, h, w]


def test_seeded_draws_are_reproducible_and_keyed() -> None:
    a = draw_params(8, batch_generator(7, 2, 0, 3), 0.5)
    b = draw_params(8, batch_generator(7, 2, 0, 3), 0.5)
    c = draw_params(8, batch_generator(7, 3, 0, 3), 0.5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_dtype_and_channels_last(dtype: torch.dtype) -> None:
    imgs = _images(4)
    cfg = LoaderConfig(size=16, dtype=dtype, channels_last=True)
    u, f = draw_params(4, torch.Generator().manual_seed(0), 0.5)
    out = transform_batch(imgs, u, f, cfg)
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    ref = reference_batch(imgs, u, f, LoaderConfig(size=16))
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7 * 3
    assert (out.float() - ref).abs().max() <= tol * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip(name: str) -> None:
    cfg = PRESETS[name]
    assert LoaderConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("bad", [
    {"batch_size": 0}, {"size": 0}, {"scale": (0.5, 0.1)}, {"scale": (0.0, 1.0)}, {"ratio": (2.0, 1.0)},
    {"flip": 1.5}, {"crop_fraction": 0.0}, {"std": (1.0, 0.0, 1.0)}, {"shard_id": 2, "num_shards": 2},
    {"num_workers": -1}, {"prefetch": 0}, {"pipeline": "dali"}, {"dtype": "int8"}, {"dtype": torch.int32},
])
def test_bad_config_raises(bad: dict) -> None:
    with pytest.raises(UsageError):
        LoaderConfig(**bad)


def test_unknown_json_field_raises() -> None:
    with pytest.raises(UsageError, match="unknown"):
        LoaderConfig.from_json('{"batch_size": 4, "bogus": 1}')


def test_math_import_used() -> None:
    assert math.isclose(LoaderConfig().ratio[0], 0.75)


def test_fused_transform_equals_eager() -> None:
    """The GPU pipeline's default: the gather-blend-normalize compiled into one kernel (Inductor C++ here,
    Triton on CUDA) gives the eager result, for both layouts and a second batch size (no stale shapes)."""
    g = torch.Generator().manual_seed(0)
    for cl in (True, False):
        cfg = LoaderConfig(size=24, channels_last=cl, dtype=torch.float32)
        for n in (4, 7):
            imgs = [torch.randint(0, 256, (3, 30 + 7 * i, 40 + 3 * i), dtype=torch.uint8, generator=g) for i in range(n)]
            u, f = draw_params(n, g, 0.5)
            got = transform_batch(imgs, u, f, cfg, fused=True)
            want = transform_batch(imgs, u, f, cfg)
            assert got.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
