"""Timing one step as an engine runs it: on CUDA replayed in a CUDA graph (a layer's cost is its kernels' time, not
their launches'), elsewhere called directly. Shared by the build-time choices (per-layer precision, conv fusion,
sibling GEMMs), so it depends on none of them.

    >>> ms = median_ms(lambda: torch.ones(8) * 2, torch.device("cpu"))
    >>> ms > 0
    True
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from overdrive._utils.timing import time_fn


def graphed(fn: Any, device: torch.device, calls: int = 10) -> Any:
    """On CUDA, ``fn`` called ``calls`` times captured in one CUDA graph (the engine replays CUDA graphs, so a layer's
    cost is its kernels' time, not their launches'); None where capture fails (then calls are timed as they are)."""
    if device.type != "cuda":
        return None
    try:
        fn()  # warm: compiled steps compile outside the capture
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        return g.replay
    except Exception:  # noqa: BLE001 - an op that cannot be captured: time the calls as launched
        return None


def median_ms(fn: Any, device: torch.device, budget_s: float = 0.5) -> float:
    """Median ms of ``fn``: one probe call sets how many calls fit ``budget_s`` (3..20), then those are timed."""
    replay = graphed(fn, device)
    if replay is not None:
        return 1e3 * statistics.median(time_fn(replay, device, warmup=2, repeat=10)) / 10
    probe = time_fn(fn, device, warmup=1, repeat=1)[0]
    n = max(3, min(20, int(budget_s / max(probe, 1e-6))))
    return 1e3 * statistics.median(time_fn(fn, device, warmup=1, repeat=n))


PAIRED_ROUNDS = 5
"""Interleaved rounds of :func:`paired_ms` (the whole-engine timing of an int8/fp8 build) (each times both engines 10 calls after 2 warm-up calls)."""


def paired_ms(a: Callable[[], Any], b: Callable[[], Any], device: torch.device,
              rounds: int = PAIRED_ROUNDS) -> tuple[float, float]:
    """Median ms per call of ``a`` and of ``b``, timed in interleaved rounds (so a clock or a neighbour's load
    that drifts during the timing weighs on both alike).

    Example:
        >>> ta, tb = paired_ms(lambda: sum(range(100)), lambda: sum(range(10_000)), torch.device("cpu"), rounds=2)
        >>> ta < tb
        True
    """
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(rounds):
        ta += time_fn(a, device, warmup=2, repeat=10)
        tb += time_fn(b, device, warmup=2, repeat=10)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)
