"""Tiny image datasets written with Pillow: JPEG (baseline, progressive, grayscale, CMYK), PNG, and broken files."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")


def smooth_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A smooth color image (JPEG-friendly, so decoders agree closely), (h, w, 3) uint8."""
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    f = rng.uniform(1, 6, size=(3, 2))
    ph = rng.uniform(0, 6.28, size=3)
    chans = [127 + 120 * np.sin(f[c, 0] * 3.14 * yy + f[c, 1] * 3.14 * xx + ph[c]) for c in range(3)]
    return np.stack(chans, -1).astype(np.uint8)


def jpeg_bytes(arr: np.ndarray, mode: str = "RGB", **kw) -> bytes:
    img = Image.fromarray(arr)
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    # 4:4:4 chroma: decoders differ in how they upsample subsampled chroma (nvJPEG vs libjpeg's
    # "fancy" upsampling gave a mean of 6.8 levels on these images on the H200), which would hide
    # what the GPU tests check: that the decode and the pipeline agree up to IDCT rounding.
    kw.setdefault("subsampling", 0)
    img.save(buf, format="JPEG", quality=95, **kw)
    return buf.getvalue()


def write_folder(root: Path, n: int, classes: int = 3, seed: int = 0, sizes: tuple[int, int] = (24, 72)) -> Path:
    rng = np.random.default_rng(seed)
    for i in range(n):
        h, w = (int(v) for v in rng.integers(sizes[0], sizes[1], size=2))
        d = root / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:04d}.jpg").write_bytes(jpeg_bytes(smooth_image(rng, h, w)))
    return root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """22 baseline JPEGs in 3 class folders, sizes 24-72 px."""
    return write_folder(tmp_path / "imgs", 22)


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """One of each: baseline, progressive, grayscale, CMYK JPEG, PNG, RGBA PNG; plus a corrupt and a truncated file."""
    rng = np.random.default_rng(1)
    root = tmp_path / "mixed"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir(parents=True)
    arr = smooth_image(rng, 40, 56)
    (root / "a" / "baseline.jpg").write_bytes(jpeg_bytes(arr))
    (root / "a" / "progressive.jpg").write_bytes(jpeg_bytes(arr, progressive=True))
    (root / "a" / "gray.jpg").write_bytes(jpeg_bytes(arr, mode="L"))
    (root / "a" / "cmyk.jpg").write_bytes(jpeg_bytes(arr, mode="CMYK"))
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    (root / "b" / "image.png").write_bytes(buf.getvalue())
    buf = io.BytesIO()
    Image.fromarray(np.concatenate([arr, np.full((40, 56, 1), 200, np.uint8)], -1)).save(buf, format="PNG")
    (root / "b" / "rgba.png").write_bytes(buf.getvalue())
    (root / "b" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg at all" * 3)
    full = jpeg_bytes(arr)
    (root / "b" / "truncated.jpg").write_bytes(full[: len(full) // 2])
    return root
