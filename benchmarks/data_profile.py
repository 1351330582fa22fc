"""Where one epoch of the GPU image pipeline spends its time: each stage timed apart.

Stages, each over the same epoch of JPEGs (the data benchmark's dataset): read the bytes (1 thread,
N threads), parse the JPEG headers, wrap bytes as tensors, nvJPEG batched decode (batch 64/256; one
thread and two threads at once, which shows whether decode holds the GIL), the batched
crop/flip/resize/normalize (split into the pad-copy and the grid_sample part), then the whole
loader with 1, 2 and 4 GPU threads, and torch.profiler's CPU-op table over a few loader batches.

    python benchmarks/data_profile.py            # H200: about 1.5 minutes
    python benchmarks/data_profile.py --quick    # CPU smoke run (no GPU stages)
Writes benchmarks/results/data_profile.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, write_results  # noqa: E402

from overdrive import data  # noqa: E402
from overdrive.data.config import LoaderConfig  # noqa: E402
from overdrive.data.decode import decode_gpu, jpeg_info  # noqa: E402
from overdrive.data.sources import resolve  # noqa: E402
from overdrive.data.transforms import draw_params, transform_batch  # noqa: E402


def rate(n: int, fn: Callable[[], Any], sync: bool, repeat: int = 3) -> float:
    """Best-of-``repeat`` images/s for ``fn`` processing ``n`` images."""
    best = float("inf")
    for _ in range(repeat):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best


def loader_rate(root: Path, cfg: LoaderConfig, device: torch.device, warmup: int = 2) -> float:
    loader = data.ImageLoader(root, device=device, config=cfg, pipeline="gpu", batch_size=cfg.batch_size)
    n, t0 = 0, None
    for k, (x, _) in enumerate(loader):
        if k == warmup - 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        elif k >= warmup:
            n += x.shape[0]
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--images", type=int, default=None)
    ap.add_argument("--dir", default="/tmp/overdrive_data_bench")
    args = ap.parse_args()
    q = args.quick
    n = args.images or (64 if q else 5000)
    gpu = torch.cuda.is_available() and not q
    device = torch.device("cuda" if gpu else "cpu")
    root = Path(args.dir) / f"jpeg_{n}_{'quick' if q else 'full'}"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)  # what an interrupted run left
        data.make_sample_dataset(root, n=n, size=(128, 96) if q else (500, 375), processes=min(16, os.cpu_count() or 1))
        (root / "done").write_text("ok")
    samples, _ = resolve(root)
    bs = 16 if q else 256
    cfg = LoaderConfig(batch_size=bs, size=64 if q else 224, dtype=torch.bfloat16, channels_last=True, drop_last=True)
    rows: list[dict[str, Any]] = []

    def add(stage: str, img_s: float, note: str = "") -> None:
        rows.append({"stage": stage, "img_per_s": img_s, "us_per_img": 1e6 / img_s, "note": note})
        print(rows[-1], flush=True)

    N = len(samples)
    add("read bytes, 1 thread", rate(N, lambda: [s.read() for s in samples], False))
    for t in (8, 16):
        with ThreadPoolExecutor(t) as ex:
            add(f"read bytes, {t} threads", rate(N, lambda: list(ex.map(lambda s: s.read(), samples)), False))
    datas = [s.read() for s in samples]
    add("parse JPEG headers (jpeg_info)", rate(N, lambda: [jpeg_info(d) for d in datas], False))
    add("bytes -> uint8 tensor (frombuffer)", rate(N, lambda: [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas], False))
    if gpu:
        from torchvision.io import ImageReadMode, decode_jpeg

        tens = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        for b in (64, 256):
            chunks = [tens[i:i + b] for i in range(0, N - b + 1, b)]
            m = len(chunks) * b
            add(f"nvJPEG decode_jpeg, batch {b}, 1 thread",
                rate(m, lambda: [decode_jpeg(c, mode=ImageReadMode.RGB, device=device) for c in chunks], True))
        chunks = [tens[i:i + bs] for i in range(0, N - bs + 1, bs)]
        m = len(chunks) * bs

        def two_threads() -> None:
            def work(cs: list) -> None:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    for c in cs:
                        decode_jpeg(c, mode=ImageReadMode.RGB, device=device)
                s.synchronize()
            ts = [threading.Thread(target=work, args=(chunks[i::2],)) for i in range(2)]
            [t.start() for t in ts]
            [t.join() for t in ts]
        add(f"nvJPEG decode_jpeg, batch {bs}, 2 threads (each its stream)", rate(m, two_threads, True),
            "about 2x the 1-thread rate if decode releases the GIL and overlaps")
        add(f"nvJPEG decode_jpeg, per image (loop), batch {bs}",
            rate(bs * 2, lambda: [decode_jpeg(t, mode=ImageReadMode.RGB, device=device) for t in tens[:bs * 2]], True))
        add("decode_gpu (overdrive: header parse + nvJPEG + fallback)",
            rate(m, lambda: [decode_gpu([datas[i] for i in range(k, k + bs)], device) for k in range(0, m, bs)], True))
        decoded = [decode_jpeg(c, mode=ImageReadMode.RGB, device=device) for c in chunks]
        gen = torch.Generator().manual_seed(0)
        params = [draw_params(bs, gen, 0.5) for _ in decoded]
        add("transform_batch eager (cat + gather + bilinear blend + normalize)",
            rate(m, lambda: [transform_batch(ims, u, f, cfg) for ims, (u, f) in zip(decoded, params)], True))
        transform_batch(decoded[0], *params[0], cfg, fused=True)  # compile outside the timing
        add("transform_batch fused (one torch.compile'd kernel)",
            rate(m, lambda: [transform_batch(ims, u, f, cfg, fused=True) for ims, (u, f) in zip(decoded, params)], True))
        add("  of which: the cat into one buffer", rate(m, lambda: [torch.cat([i.reshape(-1) for i in ims]) for ims in decoded], True))
        for threads, readers in ((1, 8), (2, 4), (2, 8), (3, 8), (4, 12)):
            c = LoaderConfig(**{**cfg.to_dict(), "gpu_threads": threads, "read_workers": readers, "dtype": torch.bfloat16})
            add(f"ImageLoader gpu, {threads} GPU thread(s), {readers} reader processes", loader_rate(root, c, device))

        from torch.profiler import ProfilerActivity, profile

        loader = data.ImageLoader(root, device=device, config=cfg, pipeline="gpu", batch_size=bs)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k, _ in enumerate(loader):
                if k == 5:
                    break
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
        cuda_table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60)
    else:
        table = cuda_table = "(no GPU: the GPU stages were not run)"
    facts = device_facts(device)
    notes = [f"dataset: {N} JPEGs ~500x375 q90 (benchmarks/data.py's), batch {bs}, output {cfg.size}x{cfg.size} bf16 "
             "channels_last; rates are best of 3 passes over the epoch (loader: one epoch after 2 warm-up batches)",
             f"host: {os.cpu_count()} CPU cores"]
    write_results("data_profile_quick" if q else "data_profile", facts, rows, ["stage", "img_per_s", "us_per_img", "note"], notes,
                  {"profiler_cpu_ops": table, "profiler_cuda_kernels": cuda_table})
    print(table)
    print(cuda_table)


if __name__ == "__main__":
    main()
