"""The loader's settings as one typed config: validated, with presets and a JSON round trip."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError

PIPELINES = ("auto", "cpu", "gpu")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "uint8": torch.uint8}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def parse_out_dtype(value: torch.dtype | str) -> torch.dtype:
    """float32 / float16 / bfloat16, or uint8 (raw pixels, not normalized): a torch dtype or its name."""
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):
            raise UsageError(f"dtype={value} is not supported; use torch.float32, torch.float16, torch.bfloat16, or "
                             "torch.uint8 for the pixels unnormalized")
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise UsageError(f"dtype={value!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers(wanted: int = 4) -> int:
    """A default worker count: ``wanted``, capped at the usable cores (4 DataLoader workers on 2 cores only
    oversubscribe them, and torch warns about it).

    Example:
        >>> 1 <= default_workers() <= 4
        True
    """
    return min(wanted, usable_cpus())


_INT_FIELDS = ("batch_size", "size", "seed", "shard_id", "num_shards", "num_workers", "read_workers", "gpu_threads",
               "prefetch")


@dataclass(frozen=True)
class LoaderConfig(ConfigBase):
    """What :class:`~overdrive.data.ImageLoader` does to each batch.

    ``train=True``: per-sample RandomResizedCrop(``scale``, ``ratio``) + horizontal flip (probability
    ``flip``), each sample with its own draw. ``train=False``: resize the shorter side to
    ``round(size / crop_fraction)`` and center-crop ``size``. Then ``(x/255 - mean) / std`` in ``dtype``; with
    ``dtype=torch.uint8`` the pixels themselves, rounded to 0-255 and not normalized (DALI's ``crop_mirror_normalize``
    with ``dtype=types.UINT8`` and no mean/std): ``mean`` / ``std`` other than their defaults are then refused, and
    the model normalizes on the device, e.g. ``(x.float() / 255 - mean) / std``.

    Example:
        >>> cfg = LoaderConfig(batch_size=128, size=160)
        >>> LoaderConfig.from_json(cfg.to_json()) == cfg
        True
    """

    batch_size: int = 256
    size: int = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    crop_fraction: float = 0.875
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    drop_last: bool = False
    seed: int = 0
    shard_id: int = 0
    num_shards: int = 1
    num_workers: int = field(default_factory=default_workers)  # CPU pipeline: decode/augment processes, 4 capped
    #                                                            at the usable cores (0: in the calling process)
    read_workers: int = 12  # GPU pipeline: processes that read and pack each batch's file bytes (0: the decoding thread reads)
    gpu_threads: int = 4  # GPU pipeline: batches decoded concurrently (each its own thread and CUDA stream)
    fused: bool = False  # GPU pipeline: crop/resize/normalize as one torch.compile'd kernel (compiles once, ~10-20 s;
    #                      no faster end to end on the H200: benchmarks/results/data.md)
    prefetch: int = 2  # batches prepared ahead (bounded queue depth)
    pipeline: str = "auto"
    persistent_workers: bool = False  # CPU pipeline: keep the worker processes from one epoch to the next (as
    #                                   DataLoader's option; ImageLoader.close() or the loader's end stops them)
    apply_exif_orientation: bool = False  # turn photos upright as their EXIF tag says (PIL's exif_transpose); off as
    #                                       in torchvision's decode_image and ImageFolder: pixels as stored
    # fields added after configs were first saved: left out of to_json() at their default, so old JSON round-trips
    _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("persistent_workers", "apply_exif_orientation")

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_out_dtype(self.dtype))
        for name in ("scale", "ratio", "mean", "std"):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, tuple(float(v) for v in value))
            except (TypeError, ValueError):
                default = getattr(LoaderConfig, name)
                raise UsageError(f"{name}={value!r} must be a sequence of numbers, e.g. {default}") from None
            if not all(math.isfinite(v) for v in getattr(self, name)):  # a NaN std made every batch NaN, silently
                raise UsageError(f"{name}={value!r} holds a NaN or infinite value; give finite numbers, e.g. "
                                 f"{getattr(LoaderConfig, name)}")
        for name in _INT_FIELDS:  # a float here failed late (slicing, manual_seed) or gave a wrong len()
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise UsageError(f"{name}={value!r} must be an int" + (" (use // for integer division, e.g. "
                                 "batch_size=global_batch // world_size)" if isinstance(value, float) else ""))
            object.__setattr__(self, name, int(value))  # NumPy ints become ints: to_json() can write them
        for name in ("train", "channels_last", "drop_last", "fused", "persistent_workers", "apply_exif_orientation"):  # train="no" is truthy
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise UsageError(f"{name}={value!r} must be True or False")
            object.__setattr__(self, name, bool(value))
        if self.batch_size < 1:
            raise UsageError(f"batch_size={self.batch_size} must be >= 1")
        if self.size < 1:
            raise UsageError(f"size={self.size} must be >= 1 (the output side in pixels)")
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise UsageError(f"scale={self.scale} must be (lo, hi) with 0 < lo <= hi <= 1, e.g. (0.08, 1.0)")
        if len(self.ratio) != 2 or not 0 < self.ratio[0] <= self.ratio[1]:
            raise UsageError(f"ratio={self.ratio} must be (lo, hi) with 0 < lo <= hi, e.g. (3/4, 4/3)")
        if not 0 <= self.flip <= 1:
            raise UsageError(f"flip={self.flip} must be a probability in [0, 1]")
        if not 0 < self.crop_fraction <= 1:
            raise UsageError(f"crop_fraction={self.crop_fraction} must be in (0, 1], e.g. 0.875")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise UsageError(f"mean={self.mean} / std={self.std} must be 3 values each, std > 0")
        if self.dtype == torch.uint8 and (self.mean, self.std) != (IMAGENET_MEAN, IMAGENET_STD):
            # uint8 holds 0-255 pixels: a normalized value (about -2..2) would be clamped to 0, 1 or 2
            raise UsageError(f"mean={self.mean} / std={self.std} cannot apply to dtype=torch.uint8, whose batches are "
                             "the pixels unnormalized (0-255); leave mean and std at their defaults and normalize "
                             "on the device, e.g. (x.float() / 255 - mean) / std, or use dtype=torch.float32, "
                             "float16 or bfloat16 for normalized batches")
        if max(abs(m) for m in self.mean) > 1 or max(self.std) > 1:
            # DALI's crop_mirror_normalize takes 0-255 units (mean=[0.485*255, ...]); here they would be divided by
            # 255 once more, and every image would come out nearly constant
            raise UsageError(f"mean={self.mean} / std={self.std} look like 0-255 pixel units; overdrive.data takes "
                             "torchvision's 0-1 units (ImageNet: mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, "
                             "0.225)): divide DALI-style values by 255")
        if self.num_shards < 1 or not 0 <= self.shard_id < self.num_shards:
            raise UsageError(f"shard_id={self.shard_id} must be in [0, num_shards={self.num_shards})")
        for name, lowest in (("num_workers", 0), ("read_workers", 0), ("gpu_threads", 1), ("prefetch", 1)):
            value = getattr(self, name)
            if value < lowest:
                raise UsageError(f"{name}={value} must be >= {lowest}" + (" (0: work in the calling process)" if lowest == 0 else ""))
        if self.pipeline not in PIPELINES:
            raise UsageError(f"pipeline={self.pipeline!r} is not one of {PIPELINES}")


# DALI's reader and operator arguments that scripts pass through, and what each is here: an unknown option named
# in this table is refused with its counterpart instead of the list of every field.
DALI_OPTIONS: dict[str, str] = {
    "random_shuffle": "shuffle=True (the default when train=True)",
    "num_threads": "num_workers=N (CPU pipeline processes) or gpu_threads=N (GPU pipeline)",
    "device_id": "device='cuda:N'",
    "crop": "size=N (the output side)",
    "output_layout": "channels_last=True for NHWC (NCHW is the default)",
    "prefetch_queue_depth": "prefetch=N",
    "pad_last_batch": "drop_last=False (the last, partial batch is kept; shards are padded to equal length)",
    "file_root": "the first argument: ImageLoader('train/', ...)",
    "file_list": "the first argument: ImageLoader('train.txt', ...) reads '<path> <label>' lines",
    "resize_shorter": "crop_fraction=size / resize_shorter (evaluation resizes the shorter side to size / crop_fraction)",
    "random_area": "scale=(lo, hi)",
    "random_aspect_ratio": "ratio=(lo, hi)",
    "mirror": "flip=p (the probability of a horizontal flip)",
    "output_dtype": "dtype=torch.float16 (or bfloat16, float32; torch.uint8 for the pixels unnormalized)",
}


# Presets: ImageNet-style training and evaluation.
IMAGENET_TRAIN = LoaderConfig()
IMAGENET_EVAL = LoaderConfig(train=False)
PRESETS: dict[str, LoaderConfig] = {"imagenet_train": IMAGENET_TRAIN, "imagenet_eval": IMAGENET_EVAL}
