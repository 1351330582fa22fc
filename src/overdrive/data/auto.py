"""Measure the CPU and GPU pipelines on the dataset at hand; ``pipeline="auto"`` picks the faster."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from overdrive._utils.optional import is_available
from overdrive._utils.timing import synchronize

if TYPE_CHECKING:
    from overdrive.data.loader import ImageLoader

log = logging.getLogger("overdrive.data")


def measure(loader: ImageLoader, pipeline: str, batches: int = 3, warmup: int = 1, num_workers: int | None = None) -> float:
    """Images/s of ``pipeline`` over ``batches`` batches after ``warmup`` (worker start-up, CUDA init excluded).

    Example:
        >>> # measure(ImageLoader("train/", pipeline="cpu"), "cpu", batches=5)
    """
    all_batches = loader._batches()[: warmup + batches]
    if len(all_batches) <= warmup:
        all_batches = all_batches * (warmup + 1)
    cfg = loader.config if num_workers is None else replace(loader.config, num_workers=num_workers)
    if pipeline == "gpu":
        saved, loader.config = loader.config, cfg
        try:
            it = loader._iter_gpu(all_batches)
        finally:
            loader.config = saved
    else:
        it = loader._iter_cpu(all_batches, cfg)
    images = 0
    t0 = time.perf_counter() if warmup == 0 else 0.0
    try:
        for k, (x, _) in enumerate(it):
            if k < warmup:
                if k == warmup - 1:
                    synchronize(loader.device)
                    t0 = time.perf_counter()
                continue
            images += x.shape[0]
        synchronize(loader.device)
    finally:
        it.close()
    seconds = time.perf_counter() - t0
    return images / seconds if seconds > 0 and images else float("nan")


def choose_pipeline(loader: ImageLoader, batches: int = 3) -> tuple[str, str]:
    """('cpu' | 'gpu', the reason in words). Measures both when both can run."""
    if loader.device.type != "cuda":
        reason = "auto chose cpu: the target device is the CPU"
    elif not is_available("torchvision"):
        reason = "auto chose cpu: torchvision (nvJPEG decode) is not installed; pip install 'overdrive[vision]'"
    else:
        try:
            gpu = measure(loader, "gpu", batches)
        except Exception as exc:  # e.g. a torchvision build without nvJPEG: the CPU pipeline still works
            reason = f"auto chose cpu: the GPU pipeline failed here ({type(exc).__name__}: {exc})"
            log.warning(reason)
            return "cpu", reason
        cpu = measure(loader, "cpu", batches)
        choice = "gpu" if gpu >= cpu else "cpu"
        reason = (f"auto chose {choice}: measured {gpu:,.0f} img/s on the GPU pipeline vs {cpu:,.0f} img/s on the CPU "
                  f"pipeline ({loader.config.num_workers} workers) over {batches} batches of {loader.config.batch_size}")
        log.info(reason)
        return choice, reason
    log.info(reason)
    return "cpu", reason


def bench(source: Any, batch_size: int = 256, size: int = 224, workers: tuple[int, ...] = (0, 4), batches: int = 5,
          device: str = "auto", train: bool = True) -> list[dict[str, Any]]:
    """img/s of the CPU pipeline with each worker count and of the GPU pipeline (where CUDA is).

    Example:
        >>> # for row in bench("train/", workers=(4, 16)): print(row)
    """
    from overdrive.data.loader import ImageLoader

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
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
