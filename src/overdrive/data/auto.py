"""Measure the CPU and GPU pipelines on the dataset at hand; ``pipeline="auto"`` picks the faster."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.optional import is_available
from overdrive._utils.timing import synchronize

if TYPE_CHECKING:
    from overdrive.data.loader import ImageLoader

log = logging.getLogger("overdrive.data")


def warmup_batches(loader: ImageLoader, pipeline: str, num_workers: int | None = None) -> int:
    """Batches to discard before timing ``pipeline``: one per parallel producer (CPU worker or GPU thread).

    Each producer's first batch carries its start-up (process spawn and imports for CPU workers, CUDA and
    nvJPEG initialisation for the GPU threads), and workers come up one after another; once every
    producer has delivered a batch, the next batches arrive at the steady-state rate.

    Example:
        >>> # warmup_batches(loader, "cpu", num_workers=16)  # -> 16
    """
    cfg = loader.config
    if pipeline == "gpu":
        return max(1, cfg.gpu_threads)
    return max(1, cfg.num_workers if num_workers is None else num_workers)


def measure(loader: ImageLoader, pipeline: str, batches: int = 3, warmup: int | None = None, num_workers: int | None = None,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Steady-state images/s of ``pipeline``, timed after ``warmup`` discarded batches.

    ``warmup`` defaults to :func:`warmup_batches` (one batch per CPU worker or GPU thread), so worker
    start-up, CUDA init and the first batches' latency are not timed. The timed batches are ``batches``
    rounded up to a whole number of rounds (a multiple of the producer count): batch k comes from
    producer k % P, so the clock starts and stops on the same producer's batches and a producer that
    started late (or one that ran ahead) does not bias the rate. The clock starts when the last warm-up
    batch has arrived (after a device synchronize) and stops after the last timed batch. A dataset
    shorter than needed is cycled. ``clock`` is for tests.

    Example:
        >>> # measure(ImageLoader("train/", pipeline="cpu", num_workers=8), "cpu", batches=8)
    """
    if batches < 1:
        raise UsageError(f"measure(batches={batches}): need at least 1 timed batch")
    producers = warmup_batches(loader, pipeline, num_workers)
    if warmup is None:
        warmup = producers
    batches = math.ceil(batches / producers) * producers
    epoch = loader._batches()
    if not epoch:
        raise UsageError("measure(): the loader has no batches (empty dataset, or drop_last with fewer images than a batch)")
    need = warmup + batches
    all_batches = (epoch * math.ceil(need / len(epoch)))[:need]
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
    t0 = clock() if warmup == 0 else 0.0
    try:
        for k, (x, _) in enumerate(it):
            if k < warmup:
                if k == warmup - 1:
                    synchronize(loader.device)
                    t0 = clock()
                continue
            images += x.shape[0]
        synchronize(loader.device)
        seconds = clock() - t0
    finally:
        it.close()
    return images / seconds if seconds > 0 and images else float("nan")


def choose_pipeline(loader: ImageLoader, batches: int = 3) -> tuple[str, str]:
    """('cpu' | 'gpu', the reason in words). Measures both when both can run.

    Both pipelines are timed over the same number of steady-state batches (at least ``batches``, and at
    least one per CPU worker and per GPU thread), each after its own warm-up (see :func:`measure`).
    """
    if loader.device.type != "cuda":
        reason = "auto chose cpu: the target device is the CPU"
    elif not is_available("torchvision"):
        reason = "auto chose cpu: torchvision (nvJPEG decode) is not installed; pip install -e '.[vision]' in a clone of overdrive"
    else:
        cfg = loader.config
        try:
            gpu, cpu, steady = probe(loader, batches)
        except _GpuProbeFailed as failed:  # e.g. a torchvision build without nvJPEG: the CPU pipeline still works
            exc = failed.__cause__
            reason = f"auto chose cpu: the GPU pipeline failed here ({type(exc).__name__}: {exc})"
            log.warning(reason)
            return "cpu", reason
        choice = "gpu" if gpu >= cpu else "cpu"
        reason = decision_text(choice, gpu, cpu, steady, cfg.batch_size, warmup_batches(loader, "gpu"),
                               warmup_batches(loader, "cpu"), cfg.gpu_threads, cfg.num_workers)
        log.info(reason)
        return choice, reason
    log.info(reason)
    return "cpu", reason


class _GpuProbeFailed(Exception):
    """The GPU pipeline raised while being probed (the cause is chained)."""


def steady_batches(loader: ImageLoader, batches: int = 3) -> int:
    """How many batches :func:`probe` times on each pipeline: at least ``batches``, a whole number of
    rounds of both the CPU workers and the GPU threads (so the same count is fair to both).

    Example:
        >>> # steady_batches(loader(num_workers=16, gpu_threads=2), 3)  # -> 16
    """
    period = math.lcm(warmup_batches(loader, "cpu"), warmup_batches(loader, "gpu"))
    return math.ceil(max(batches, 1) / period) * period


def probe(loader: ImageLoader, batches: int = 3, clock: Callable[[], float] = time.perf_counter) -> tuple[float, float, int]:
    """(GPU img/s, CPU img/s, batches timed on each): both pipelines timed over the same number of
    steady-state batches, each after discarding its own warm-up (one batch per worker / thread).

    Example:
        >>> # gpu, cpu, n = probe(ImageLoader("train/", device="cuda", pipeline="cpu"))
    """
    steady = steady_batches(loader, batches)
    try:
        gpu = measure(loader, "gpu", steady, clock=clock)
    except Exception as exc:
        raise _GpuProbeFailed() from exc
    cpu = measure(loader, "cpu", steady, clock=clock)
    return gpu, cpu, steady


def decision_text(choice: str, gpu: float, cpu: float, steady: int, batch_size: int, gpu_warmup: int, cpu_warmup: int,
                  gpu_threads: int, num_workers: int) -> str:
    """The words of ``loader.decision`` after a measured choice: both rates and what was timed.

    Example:
        >>> decision_text("cpu", 100.0, 200.0, 4, 32, 2, 4, 2, 4)[:16]
        'auto chose cpu: '
    """
    return (f"auto chose {choice}: steady-state {gpu:,.0f} img/s on the GPU pipeline ({gpu_threads} threads) vs "
            f"{cpu:,.0f} img/s on the CPU pipeline ({num_workers} workers), each timed over the same {steady} batches "
            f"of {batch_size} after discarding its first {gpu_warmup} (GPU) / {cpu_warmup} (CPU) batches "
            f"(worker start-up, CUDA init and first-batch latency not timed)")
