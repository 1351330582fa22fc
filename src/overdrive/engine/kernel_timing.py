"""Timing one step as an engine runs it: on CUDA replayed in a CUDA graph (a layer's cost is its kernels' time, not
their launches'), elsewhere called directly. Shared by the build-time choices (per-layer precision, conv fusion,
sibling GEMMs), so it depends on none of them.

    >>> ms = median_ms(lambda: torch.ones(8) * 2, torch.device("cpu"))
    >>> ms > 0
    True
"""

from __future__ import annotations

import statistics
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
