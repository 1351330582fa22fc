"""Calibration data that is not a tensor file: a folder of images for an image model, a text file for a token
model. :func:`overdrive.recipes.calibration.load_calibration` reads them through here, so ``overdrive build
--calib`` and ``overdrive quantize --calib-data`` take them as they take a ``.pt`` file.

An image folder is torchvision's ImageFolder layout (``root/<class>/<image>``, nested folders allowed) or a flat
folder of images (``.jpg``, ``.png``, ``.webp``, ...). Images are found in sorted path order and up to ``samples``
are taken evenly spaced over that order (every class is represented, and the same images are taken on every
run). Each is decoded with Pillow (:func:`overdrive.data.decode.decode_cpu`, RGB; gray for a 1-channel model),
resized as torchvision's evaluation transform does (``Resize(round(size / crop_fraction))`` on the shorter side,
antialiased, then ``CenterCrop(size)``), scaled to [0, 1] and normalized ``(x - mean) / std``; ImageNet's mean and
std unless the model says otherwise (a timm model's ``pretrained_cfg``) or ``normalize`` names others.

A ``.txt`` file holds one sample per line (blank lines skipped); overdrive tokenizes it only for the models whose
tokenizer it knows (the ``docstrings`` byte model). For any other model it says to save the tokenizer's output.

Example:
    >>> parse_normalize("0.5:0.25")
    ((0.5,), (0.25,))
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the same numbers as overdrive.data.config's
IMAGENET_STD = (0.229, 0.224, 0.225)
TEXT_SUFFIXES = (".txt",)
NORMALIZE_FORM = "'imagenet', 'none' (pixels in [0, 1]) or MEAN:STD, e.g. 0.5,0.5,0.5:0.5,0.5,0.5"


@dataclass(frozen=True)
class ImageOptions:
    """How an image folder becomes a calibration tensor (N, C, H, W).

    ``input_shape``: the model's input shape, (C, H, W) or (N, C, H, W) for an image folder (a tensor file's
    inputs may have any rank); None takes a timm model's
    ``pretrained_cfg["input_size"]``. ``normalize``: :func:`parse_normalize`'s text; None takes the model's
    ``pretrained_cfg`` mean/std, else ImageNet's. ``samples``: the most images read. ``crop_fraction``: the
    center crop's share of the resized shorter side; None takes the model's ``crop_pct``, else 0.875 (224 of 256).

    Example:
        >>> ImageOptions(input_shape=(1, 3, 32, 32), samples=64).chw()
        (3, 32, 32)
    """

    input_shape: tuple[int, ...] | None = None
    normalize: str | None = None
    samples: int = 512
    crop_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.input_shape is not None:
            shape = tuple(self.input_shape)
            if not shape or any(not isinstance(d, int) or d < 1 for d in shape):  # the rank: read_image_folder's
                raise UsageError(f"input shape {shape} must be positive integers, e.g. 1,3,224,224 or 1,16")
            object.__setattr__(self, "input_shape", shape)
        if self.samples < 1:
            raise UsageError(f"calibration samples {self.samples} must be >= 1")
        if self.crop_fraction is not None and not 0 < self.crop_fraction <= 1:
            raise UsageError(f"crop_fraction {self.crop_fraction} must be in (0, 1], e.g. 0.875")
        if self.normalize is not None:
            parse_normalize(self.normalize)  # a bad value is refused before any image is read

    def chw(self) -> tuple[int, int, int] | None:
        """(C, H, W) of the input shape given, or None."""
        return None if self.input_shape is None else tuple(self.input_shape[-3:])  # type: ignore[return-value]


def parse_normalize(text: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``imagenet`` / ``none`` / ``MEAN:STD`` (comma-separated, one value or one per channel) -> (mean, std).

    Example:
        >>> parse_normalize("none")
        ((0.0,), (1.0,))
    """
    t = text.strip().lower()
    if t == "imagenet":
        return IMAGENET_MEAN, IMAGENET_STD
    if t == "none":
        return (0.0,), (1.0,)
    if t.count(":") != 1:
        raise UsageError(f"--calib-normalize {text!r} must be {NORMALIZE_FORM}")
    try:
        mean, std = (tuple(float(v) for v in part.split(",")) for part in t.split(":"))
    except ValueError:
        raise UsageError(f"--calib-normalize {text!r}: not numbers; give {NORMALIZE_FORM}") from None
    if any(s <= 0 for s in std) or not all(v == v and abs(v) != float("inf") for v in (*mean, *std)):
        raise UsageError(f"--calib-normalize {text!r}: std must be > 0 and every value finite; give {NORMALIZE_FORM}")
    return mean, std


def model_data_config(model: nn.Module | None) -> dict[str, Any]:
    """A timm model's ``pretrained_cfg`` (or older ``default_cfg``): input_size, mean, std, crop_pct; {} if none.

    Example:
        >>> model_data_config(nn.Linear(1, 1))
        {}
    """
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None) if model is not None else None
        if isinstance(cfg, dict) and cfg.get("input_size"):
            return cfg
    return {}


def list_images(root: Path) -> list[Path]:
    """Every image under ``root`` (class subfolders or flat), hidden names skipped, in sorted path order."""
    from overdrive.data.sources import IMAGE_EXTS

    found = []
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(dirpath, f) for f in files if f.lower().endswith(IMAGE_EXTS) and not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def evenly_spaced(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)`` (all of them when k >= n).

    Example:
        >>> evenly_spaced(10, 3)
        [0, 3, 6]
    """
    return list(range(n)) if k >= n else [i * n // k for i in range(k)]


def _resize_crop(img: torch.Tensor, hw: tuple[int, int], crop_fraction: float) -> torch.Tensor:
    """(C, h, w) uint8 -> (C, H, W) float in [0, 255]: cover (H, W) / crop_fraction keeping the aspect ratio
    (the shorter side for a square), antialiased bilinear, then the center (H, W)."""
    H, W = hw
    h, w = img.shape[-2:]
    scale = max(H / crop_fraction / h, W / crop_fraction / w)
    nh, nw = max(H, round(h * scale)), max(W, round(w * scale))
    big = F.interpolate(img.float().unsqueeze(0), size=(nh, nw), mode="bilinear", align_corners=False, antialias=True)[0]
    top, left = round((nh - H) / 2), round((nw - W) / 2)
    return big[:, top:top + H, left:left + W].clamp(0, 255)


def _channels(values: Sequence[float], c: int, what: str, given: bool) -> torch.Tensor:
    if len(values) == c or len(values) == 1:
        return torch.tensor(values, dtype=torch.float32).view(-1, 1, 1).expand(c, 1, 1)
    if not given and c == 1:  # ImageNet's numbers for a gray model: their average, as the channel's
        return torch.tensor([sum(values) / len(values)]).view(1, 1, 1)
    raise UsageError(f"--calib-normalize gives {len(values)} {what} values but the model takes {c} channel(s); give "
                     f"one value or {c}, e.g. {','.join(['0.5'] * c)}:{','.join(['0.25'] * c)}")


def read_image_folder(path: str, flag: str, options: ImageOptions, model: nn.Module | None = None,
                      shape: Sequence[int] | None = None) -> torch.Tensor:
    """An image folder -> a normalized float32 tensor (N, C, H, W), N <= ``options.samples``.

    ``shape``: the input's shape from elsewhere (a build's ``--shapes``), used when ``options`` gives none.

    Example:
        >>> # x = read_image_folder("val/", "--calib", ImageOptions(input_shape=(3, 224, 224), samples=256))
    """
    root = Path(path)
    cfg = model_data_config(model)
    if options.input_shape is not None and len(options.input_shape) not in (3, 4):
        got = ",".join(map(str, options.input_shape))
        raise UsageError(f"{flag} {path!r} is an image folder but --input-shape {got} has {len(options.input_shape)} "
                         "dims; images need C,H,W or N,C,H,W (e.g. 1,3,224,224): for other inputs save them as a "
                         ".npy / .npz / .pt tensor file of shape (N, ...) instead")
    chw = options.chw() or (tuple(shape[-3:]) if shape is not None and len(shape) >= 3 else None)
    if chw is None and cfg:
        chw = tuple(int(d) for d in cfg["input_size"])
    if chw is None:
        raise UsageError(f"{flag} {path!r} is an image folder, and the model's input size is not known; give it: "
                         "--input-shape 1,3,224,224 (overdrive quantize) or --shapes x:1x3x224x224 (overdrive build)")
    c, h, w = chw
    if c not in (1, 3):
        raise UsageError(f"{flag} {path!r}: the model's input has {c} channels ({chw}); images give 3 (RGB) or 1 "
                         "(gray): check --input-shape / --shapes (C,H,W order), or save a tensor file of the inputs")
    if options.normalize is not None:
        mean, std = parse_normalize(options.normalize)
    elif cfg.get("mean") and cfg.get("std"):
        mean, std = tuple(cfg["mean"]), tuple(cfg["std"])
    else:
        mean, std = IMAGENET_MEAN, IMAGENET_STD
    given = options.normalize is not None
    m, s = _channels(mean, c, "mean", given), _channels(std, c, "std", given)
    crop = options.crop_fraction or float(cfg.get("crop_pct", 0.875))
    files = list_images(root)
    if not files:
        raise UsageError(f"{flag} {path!r} holds no images (.jpg, .png, ...); give a folder of images, flat or in "
                         "class subfolders (root/<class>/<image>.jpg), or a calibration file")
    from overdrive.data.decode import DecodeError, decode_cpu
    from overdrive.data.sources import Sample

    gray = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)  # ITU-R 601, Pillow's "L"
    out, bad = [], []
    for i in evenly_spaced(len(files), options.samples):
        try:
            img = decode_cpu(Sample(str(files[i]), 0).read())  # (3, h, w) uint8 RGB
        except (DecodeError, OSError) as exc:
            bad.append(f"{files[i].name} ({exc})")
            continue
        x = _resize_crop(img, (h, w), crop) / 255.0  # (3, H, W) in [0, 1]
        if c == 1:
            x = (x * gray).sum(0, keepdim=True)
        out.append((x - m) / s)
    if bad:
        warnings.warn(f"{flag} {path}: skipped {len(bad)} image(s) that cannot be decoded: {'; '.join(bad[:3])}"
                      f"{' ...' if len(bad) > 3 else ''}", UserWarning, stacklevel=3)
    if not out:
        raise UsageError(f"{flag} {path!r}: none of its {len(files)} image(s) could be decoded (first: {bad[0]})")
    return torch.stack(out).contiguous()  # (N, C, H, W) float32


def read_text_lines(path: str, flag: str, model: nn.Module | None, samples: int) -> torch.Tensor:
    """A text file, one sample per line -> the token ids the model takes (N, T), for a model whose tokenizer
    overdrive knows (the ``docstrings`` byte model: byte + 1, 0-padded to its sequence length).

    Example:
        >>> # ids = read_text_lines("lines.txt", "--calib-data", ByteTransformer(), samples=512)
    """
    from overdrive.recipes.textdata import SEQ, ByteTransformer

    if not isinstance(model, ByteTransformer):
        name = type(model).__name__ if model is not None else "this model"
        raise UsageError(f"{flag} {path!r} is a text file, and overdrive knows no tokenizer for {name} (it tokenizes "
                         "text only for the 'docstrings' model); tokenize the lines with the model's tokenizer and save "
                         "the ids: torch.save(dict(tok(lines, padding=True, truncation=True, return_tensors='pt')), "
                         "'calib.pt'), then pass calib.pt")
    try:
        lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag} {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8") from None
    if not lines:
        raise UsageError(f"{flag} {path!r} holds no text; write one calibration sample per line")
    lines = [lines[i] for i in evenly_spaced(len(lines), samples)]
    ids = torch.zeros(len(lines), SEQ, dtype=torch.int64)  # (N, SEQ), 0 = padding
    for r, line in enumerate(lines):
        data = list(line.encode("utf-8"))[:SEQ]
        ids[r, :len(data)] = torch.tensor(data, dtype=torch.int64) + 1
    return ids


def parse_input_shape(text: str | None, flag: str = "--input-shape") -> tuple[int, ...] | None:
    """``"1,3,224,224"`` (or ``1x3x224x224``) -> (1, 3, 224, 224); None stays None.

    Example:
        >>> parse_input_shape("3x32x32")
        (3, 32, 32)
    """
    if text is None:
        return None
    try:
        shape = tuple(int(s) for s in text.replace("x", ",").split(","))
    except ValueError:
        raise UsageError(f"{flag} {text!r} must be comma-separated integers like 1,3,224,224") from None
    if len(shape) not in (3, 4) or min(shape) < 1:
        raise UsageError(f"{flag} {text!r} must be C,H,W or N,C,H,W with positive sizes, e.g. 1,3,224,224")
    return shape
