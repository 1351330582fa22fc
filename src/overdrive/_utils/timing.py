"""Timing that is honest on both CPU and CUDA: synchronize, warm up, take medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device | str, warmup: int = 3, repeat: int = 10,
            before_each: Callable[[], object] | None = None) -> list[float]:
    """Seconds per call of ``fn`` over ``repeat`` runs after ``warmup`` runs: CUDA events around each
    call on a GPU (device work is asynchronous), the wall clock on CPU. ``before_each`` runs before each
    timed call, outside the timing (for example a barrier, so that ranks start together).

    Example:
        >>> times = time_fn(lambda: sum(range(100)), "cpu", warmup=1, repeat=3)
        >>> len(times)
        3
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    if torch.device(device).type == "cuda":
        for _ in range(repeat):
            if before_each is not None:
                before_each()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return times
    for _ in range(repeat):
        if before_each is not None:
            before_each()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)
