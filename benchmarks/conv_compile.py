"""What the int8/fp8 convolution kernel's compiles cost a build, one after another and side by side (no GPU needed).

An int8/fp8 engine build tunes the Triton convolution (``overdrive::conv2d_q``) per layer shape over its tile configs,
and every config is one compile; the build compiles them in threads (``quant.conv.compile_in_threads``). This times
``--configs`` tile configs compiled offline for ``sm_<arch>`` (``quant._triton_conv.compile_offline``: Triton to PTX
and a cubin, as the JIT compiles them on the GPU), each round in a fresh Triton cache, once one after another and once
with ``--threads`` threads. ``x`` = serial s / threaded s. Needs Triton (``pip install triton``); no GPU.

    python benchmarks/conv_compile.py                     # 6 configs, int8, 2 threads: about 20 s here
    python benchmarks/conv_compile.py --threads 8 --configs 0,1,2,12,13,15,17,20
Writes benchmarks/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, write_results  # noqa: E402


def _round(configs: list[int], threads: int, is_int: bool, out_q: int, arch: int) -> float:
    """Seconds to compile ``configs`` in a fresh Triton cache with ``threads`` threads (1: one after another)."""
    from overdrive.quant import _triton_conv as tc

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="conv_compile_")
    t0 = time.perf_counter()
    if threads <= 1:
        for c in configs:
            tc.compile_offline(is_int, c, out_q, arch=arch)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda c: tc.compile_offline(is_int, c, out_q, arch=arch), configs))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="0,1,2,12,13,15", help="comma list of tile config indexes (quant/conv_tiles)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fmt", choices=("int8", "fp8"), default="int8")
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: Hopper)")
    ap.add_argument("--rounds", type=int, default=2, help="serial / threaded pairs (each in a fresh cache)")
    ap.add_argument("--out", default="conv_compile")
    args = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("conv_compile.py needs Triton: pip install triton")
    configs = [int(c) for c in args.configs.split(",")]
    is_int = args.fmt == "int8"
    out_q = 2 if is_int else 1
    _round(configs[:1], 1, is_int, out_q, args.arch)  # Triton's own imports and set-up, outside the timing
    rows = []
    for r in range(args.rounds):
        serial = _round(configs, 1, is_int, out_q, args.arch)
        threaded = _round(configs, args.threads, is_int, out_q, args.arch)
        rows.append({"round": r, "configs": len(configs), "serial s": round(serial, 2),
                     f"{args.threads} threads s": round(threaded, 2), "x": round(serial / threaded, 2),
                     "s per compile (serial)": round(serial / len(configs), 2)})
        print(rows[-1], flush=True)
    facts = {**device_facts(torch.device("cpu")), "cpu_count": os.cpu_count(), "fmt": args.fmt,
             "arch": f"sm_{args.arch}", "configs": configs, "threads": args.threads, "triton": triton.__version__}
    notes = ["each round compiles the same configs in a fresh Triton cache: once one after another, once in threads "
             "(quant.conv.compile_in_threads does the same in a build, on the GPU machine's cores)",
             "compile_offline: the kernel specialized as the JIT specializes it for ResNet-sized layers (1x1, fp16 "
             "residual, ReLU, 8-bit output)"]
    write_results(args.out, facts, rows, list(rows[0]), notes)


if __name__ == "__main__":
    main()
