"""Collective bandwidth like nccl-tests: time, algbw, busbw per op and message size.

algbw = bytes / time. busbw corrects for how much each rank must move:
all_reduce x 2(n-1)/n, all_gather and reduce_scatter x (n-1)/n (bytes = the full output /
input of n chunks), as in nccl-tests' PERFORMANCE.md. Run inside a process group (every rank),
or as ``python -m overdrive.distributed.bandwidth`` under torchrun (``overdrive doctor --bandwidth``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.distributed as dist

from overdrive._utils.errors import UsageError
from overdrive._utils.timing import time_fn

OPS = ("all_reduce", "all_gather", "reduce_scatter")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}


def sizes_pow2(lo: int, hi: int) -> list[int]:
    """Byte sizes lo, 2lo, 4lo, ... <= hi. Example: sizes_pow2(8, 32) == [8, 16, 32]."""
    if lo < 1 or hi < lo:
        raise UsageError(f"sizes {lo}..{hi}: need 1 <= lo <= hi")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def measure(ops: tuple[str, ...] = OPS, sizes: list[int] | None = None, iters: int = 20, warmup: int = 5,
            dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    """Median time of each collective per size on the current process group; rows as nccl-tests prints."""
    if not dist.is_initialized():
        raise UsageError("measure() needs a process group: call overdrive.distributed.init() first")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise UsageError(f"unknown collective(s) {bad}; choose from {OPS}")
    n = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    esize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for size in sizes or sizes_pow2(8 * 1024, 64 * 2**20):
        count = max(n, size // esize // n * n)  # divisible by n for the chunked ops
        nbytes = count * esize
        big = torch.randn(count, device=dev).to(dtype)  # not zeros: timing on zeros can flatter
        chunk = torch.empty(count // n, device=dev, dtype=dtype)
        for op in ops:
            def run() -> None:
                if op == "all_reduce":
                    dist.all_reduce(big)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(big, chunk)
                else:
                    dist.reduce_scatter_tensor(chunk, big)
            times = _time(run, dev, iters, warmup)
            t = statistics.median(times)
            algbw = nbytes / t / 1e9
            rows.append({"op": op, "bytes": nbytes, "time_us": t * 1e6, "algbw_gbs": algbw,
                         "busbw_gbs": algbw * BUS_FACTOR[op](n), "world_size": n})
    return rows


def _time(fn: Any, dev: torch.device, iters: int, warmup: int) -> list[float]:
    # CPU (gloo): a barrier before each call, so the wall clock times the collective, not the ranks' skew
    out = time_fn(fn, dev, warmup=warmup, repeat=iters, before_each=None if dev.type == "cuda" else dist.barrier)
    # Every rank uses the slowest rank's time (the collective is as slow as its slowest member).
    t = torch.tensor(out, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="collective bandwidth (run under torchrun)")
    ap.add_argument("--min-bytes", type=int, default=8 * 1024)
    ap.add_argument("--max-bytes", type=int, default=64 * 2**20)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--out", default=None, help="rank 0 writes the rows here as JSON")
    a = ap.parse_args(argv)
    import warnings

    # torch 2.13 renames *_into_tensor / *_tensor to *_single; 2.11 (the GPU machine) lacks the new names.
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)
    from overdrive.distributed.parallel import init

    env = init(backend=a.backend)
    rows = measure(tuple(a.ops.split(",")), sizes_pow2(a.min_bytes, a.max_bytes), iters=a.iters)
    if env.is_main:
        text = json.dumps({"backend": env.backend, "world_size": env.world_size, "rows": rows})
        if a.out:
            from overdrive._utils.files import atomic_write

            atomic_write(a.out, text)
        else:
            print(text)
    from overdrive.distributed.parallel import leave

    leave()  # not destroy_process_group: gloo's teardown can abort or hang a finished rank


if __name__ == "__main__":
    main()
