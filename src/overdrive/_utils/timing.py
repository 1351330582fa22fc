"""Timing that is honest on both CPU and CUDA: synchronize, warm up, take medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


HOST_READS = ("item", "tolist", "__float__", "__bool__", "__int__")
"""The tensor methods that copy a value into Python: on a GPU, each waits for the device (a host sync)."""


@contextmanager
def count_host_reads() -> Iterator[dict[str, int]]:
    """Count the reads of a tensor's value into Python (:data:`HOST_READS`) made inside the block: on a GPU each one
    is a host sync, so a training step's count says how often the host waits for the device. CPU optimizers' ``step``
    counters are such reads too.

    Example:
        >>> with count_host_reads() as n:
        ...     _ = float(torch.ones(())), torch.zeros(2).tolist()
        >>> n["reads"]
        2
    """
    counts = {"reads": 0}
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(orig: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts["reads"] += 1
            return orig(self, *args, **kwargs)
        return read

    try:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, counting(orig))
        yield counts
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)
