"""A benchmark dataset of ImageNet-size JPEGs cut from real photos (scikit-image's sample images)."""

from __future__ import annotations

import io
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from overdrive._utils.errors import UsageError
from overdrive._utils.files import atomic_write
from overdrive._utils.optional import require

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "cat", "camera", "immunohistochemistry", "hubble_deep_field",
          "colorwheel", "retina", "moon", "page", "text", "clock", "coins", "horse", "grass", "gravel", "brick")


def _photos() -> list[np.ndarray]:
    skdata = require("skimage.data", feature="the sample dataset (scikit-image photos)", pip="scikit-image pillow")
    out = []
    for name in PHOTOS:
        fn = getattr(skdata, name, None)
        if fn is None:
            continue
        try:
            img = np.asarray(fn())
        except Exception:  # some samples need a download (pooch) that this machine cannot do
            continue
        if img.dtype == bool:
            img = img.astype(np.uint8) * 255
        if img.dtype != np.uint8:
            img = (255 * (img - img.min()) / max(float(img.max() - img.min()), 1e-9)).astype(np.uint8)
        if img.ndim == 2:
            img = np.stack([img] * 3, -1)
        out.append(img[..., :3])
    if not out:
        raise UsageError("no scikit-image sample photo could be loaded")
    return out


def _write_chunk(args: tuple[str, int, int, int, int, tuple[int, int], int]) -> int:
    root, start, stop, classes, seed, size, quality = args
    Image = require("PIL.Image", feature="the sample dataset", pip="scikit-image pillow")
    photos = _photos()
    for i in range(start, stop):
        rng = np.random.default_rng(seed * 1_000_003 + i)
        img = Image.fromarray(photos[i % len(photos)])
        W, H = img.size
        frac = rng.uniform(0.4, 1.0)  # random crop, then rescale to about ImageNet size
        cw, ch = max(int(W * frac), 16), max(int(H * frac), 16)
        x0, y0 = int(rng.integers(0, W - cw + 1)), int(rng.integers(0, H - ch + 1))
        w, h = size if rng.random() < 0.5 else size[::-1]  # landscape or portrait
        w, h = int(w * rng.uniform(0.85, 1.15)), int(h * rng.uniform(0.85, 1.15))
        crop = img.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.BILINEAR)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        label = i % classes
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", quality=quality)
        # whole or not at all: a run stopped part way leaves no truncated JPEG for a benchmark to read; not synced
        # (an fsync per image about doubled the time to write 300 on ext4, and the images can be made again)
        atomic_write(Path(root) / f"class_{label:03d}" / f"img_{i:06d}.jpg", buf.getvalue(), durable=False)
    return stop - start


def make_sample_dataset(root: str | os.PathLike, n: int = 2000, classes: int = 10, size: tuple[int, int] = (500, 375),
                        quality: int = 90, seed: int = 0, processes: int = 1) -> Path:
    """Write ``n`` JPEGs (about ``size`` = (w, h), quality ``quality``) as ``root/class_XXX/img_N.jpg``.

    Each is a random crop of one of scikit-image's sample photos, rescaled (+-15%) and maybe mirrored.

    Example:
        >>> # make_sample_dataset("/tmp/imgs", n=2000, processes=16)
    """
    if n < 1 or classes < 1:
        raise UsageError(f"n={n} and classes={classes} must be >= 1")
    if not 1 <= quality <= 100:
        raise UsageError(f"quality={quality} must be in [1, 100]")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:  # numpy's own error named no flag, and came
        raise UsageError(f"seed={seed!r} must be an int >= 0 (--seed)")  # after the class folders were made
    w, h = size
    if min(w, h) < 8:  # each image's size is drawn within +-15% of it: a 1-pixel one rounded to 0 after the folders
        raise UsageError(f"size={w}x{h}: width and height must be at least 8 pixels (--width / --height)")
    if classes > n:  # a class folder with no image: ImageFolder-style readers refuse it, this loader counts it
        warnings.warn(f"make_sample_dataset: classes={classes} > n={n}, so {classes - n} class folder(s) hold no "
                      "image; give as many images as classes or more (-n / --classes)", RuntimeWarning, stacklevel=2)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{str(root)!r} is a file; give a folder for the sample dataset")
    if root.is_dir() and any(root.iterdir()):
        # writing into it replaced same-named images (a user's own class_000/img_000000.jpg) and left the others
        # beside the new ones, a dataset of two runs' images
        raise UsageError(f"{str(root)!r} is not empty; give a new or empty folder for the sample dataset (or remove "
                         "the old one first)")
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    processes = max(1, min(processes, n))
    step = -(-n // processes)
    jobs = [(str(root), s, min(s + step, n), classes, seed, size, quality) for s in range(0, n, step)]
    if processes == 1:
        for j in jobs:
            _write_chunk(j)
    else:
        with ProcessPoolExecutor(processes) as ex:
            list(ex.map(_write_chunk, jobs))
    return root
