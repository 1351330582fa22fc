"""The public verbs of overdrive.data, in one place."""

from __future__ import annotations

from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.optional import is_available
from overdrive.data.auto import measure
from overdrive.data.config import IMAGENET_EVAL, IMAGENET_TRAIN, PRESETS, LoaderConfig
from overdrive.data.loader import ImageLoader, LoaderStats
from overdrive.data.order import shard_indices
from overdrive.data.samples import make_sample_dataset
from overdrive.data.texts import read_texts
from overdrive.data.tokenize import TokenizedTexts, prune_token_cache, tokenize

__all__ = ["ImageLoader", "LoaderConfig", "LoaderStats", "IMAGENET_TRAIN", "IMAGENET_EVAL", "PRESETS", "shard_indices",
           "bench", "measure", "make_sample_dataset", "tokenize", "TokenizedTexts", "read_texts",
           "prune_token_cache"]


def bench(source: Any, batch_size: int = 256, size: int = 224, workers: tuple[int, ...] = (0, 4), batches: int = 5,
          device: str = "auto", train: bool = True) -> list[dict[str, Any]]:
    """img/s of the CPU pipeline with each worker count and of the GPU pipeline (where CUDA is).

    Example:
        >>> # for row in bench("train/", workers=(4, 16)): print(row)
    """
    try:
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    except (RuntimeError, TypeError):  # torch's message lists every device type it knows
        raise UsageError(f"device={device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    loader = ImageLoader(source, batch_size=batch_size, device=dev, size=size, train=train, pipeline="cpu")
    rows = []
    for w in workers:
        rows.append({"pipeline": f"cpu ({w} workers)", "img_per_s": measure(loader, "cpu", batches, num_workers=w)})
    if dev.type == "cuda" and is_available("torchvision"):
        rows.append({"pipeline": "gpu (nvJPEG + grid_sample)", "img_per_s": measure(loader, "gpu", batches)})
    best = max(r["img_per_s"] for r in rows)
    for r in rows:
        r["vs_best"] = r["img_per_s"] / best
    return rows
