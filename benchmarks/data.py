"""overdrive.data benchmark: GPU image pipeline vs a 16-worker CPU DataLoader, ResNet-50 fed by it vs
synthetic data, where the GPU loses (small images), what `auto` picks, and tokenization speed.

Full mode (the H200):   python3 benchmarks/data.py
Quick mode (CPU, ~1 min): python3 benchmarks/data.py --quick
Writes benchmarks/results/data.json and .md (data_quick.* in quick mode).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from overdrive import data
from overdrive._utils.timing import synchronize
from overdrive.data.config import LoaderConfig
from overdrive.data.transforms import finish, transform_one

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_facts, write_results  # noqa: E402


# --- the plain-PyTorch baseline: a per-sample Dataset in a DataLoader --------------------------
class PlainDataset(torch.utils.data.Dataset):
    """What people write: decode one file (torchvision CPU decode, else Pillow), crop, flip, normalize."""

    def __init__(self, samples: list, cfg: LoaderConfig, use_torchvision: bool) -> None:
        self.samples, self.cfg, self.tv = samples, cfg, use_torchvision

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        s = self.samples[i]
        raw = s.read()
        if self.tv:
            from torchvision.io import ImageReadMode, decode_jpeg

            img = decode_jpeg(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode=ImageReadMode.RGB)
        else:
            from overdrive.data.decode import decode_cpu

            img = decode_cpu(raw)
        u = torch.rand(10, 4, dtype=torch.float64)  # per-sample draws, same rule as the loader's
        x = transform_one(img, u, bool(torch.rand(()) < 0.5), self.cfg)
        return finish(x.unsqueeze(0), self.cfg)[0], s.label


def plain_loader(root: Path, cfg: LoaderConfig, workers: int, device: torch.device) -> torch.utils.data.DataLoader:
    from overdrive._utils.optional import is_available
    from overdrive.data.sources import resolve

    samples, _ = resolve(root)
    ds = PlainDataset(samples, cfg, use_torchvision=is_available("torchvision"))
    return torch.utils.data.DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, num_workers=workers, drop_last=True,
                                       pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                       prefetch_factor=4 if workers > 0 else None)


def throughput(batches_of: Any, device: torch.device, warmup: int, epochs: int) -> float:
    """img/s over ``epochs`` passes after ``warmup`` batches (worker start-up, CUDA init excluded)."""
    rates = []
    for e in range(epochs):
        it = batches_of(e)
        n, t0 = 0, None
        for k, (x, y) in enumerate(it):
            if k < warmup:
                if k == warmup - 1:
                    synchronize(device)
                    t0 = time.perf_counter()
                continue
            x = x.to(device, non_blocking=True)
            n += x.shape[0]
        synchronize(device)
        if t0 is not None and n:
            rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates) if rates else float("nan")


def image_pipelines(root: Path, cfg: LoaderConfig, device: torch.device, workers: int, epochs: int) -> list[dict]:
    rows = []
    if device.type == "cuda":
        variants = [("default", {}), ("fused transform", {"fused": True}),
                    ("2 GPU threads, 8 readers", {"gpu_threads": 2, "read_workers": 8})]
        for label, kw in variants:
            gpu = data.ImageLoader(root, device=device, config=cfg, pipeline="gpu", batch_size=cfg.batch_size, **kw)
            c = gpu.config
            rows.append({"pipeline": f"overdrive GPU, {label} ({c.gpu_threads} GPU threads, {c.read_workers} reader processes)",
                         "img_per_s": throughput(lambda e: (gpu.set_epoch(e), gpu)[1], device, 2, epochs)})
            rows[-1]["cpu_fallback"] = gpu.stats.cpu_fallback
    cpu = data.ImageLoader(root, device=device, config=cfg, pipeline="cpu", batch_size=cfg.batch_size, num_workers=workers)
    rows.append({"pipeline": f"overdrive CPU ({workers} workers, Pillow)",
                 "img_per_s": throughput(lambda e: (cpu.set_epoch(e), cpu)[1], device, 2, epochs)})
    plain = plain_loader(root, cfg, workers, device)
    dec = "torchvision" if plain.dataset.tv else "Pillow"
    rows.append({"pipeline": f"plain DataLoader ({workers} workers, {dec} decode) [baseline]",
                 "img_per_s": throughput(lambda e: plain, device, 2, epochs)})
    base = rows[-1]["img_per_s"]
    for r in rows:
        r["vs_baseline"] = r["img_per_s"] / base
    return rows


# --- training fed by the pipeline vs synthetic data -------------------------------------------
def _model(quick: bool) -> torch.nn.Module:
    if quick:
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, 2, 1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
    import torchvision

    return torchvision.models.resnet50(weights=None)


def train_throughput(feed: str, root: Path, cfg: LoaderConfig, device: torch.device, steps: int, warmup: int,
                     quick: bool, workers: int) -> float:
    from overdrive.amp import Policy, prepare

    torch.manual_seed(0)
    model = _model(quick).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mp = prepare(model, opt, Policy(opt_level="O2", dtype=torch.bfloat16), device=device)
    if feed == "synthetic":
        g = torch.Generator(device=device).manual_seed(0)
        pool = [(torch.randn(cfg.batch_size, 3, cfg.size, cfg.size, device=device, generator=g).to(torch.bfloat16)
                 .contiguous(memory_format=torch.channels_last), torch.randint(0, 10, (cfg.batch_size,), device=device))
                for _ in range(4)]

        def batches():
            while True:
                yield from pool
    else:
        loader = data.ImageLoader(root, device=device, config=cfg, pipeline=feed, batch_size=cfg.batch_size,
                                  num_workers=workers, drop_last=True)

        def batches():
            e = 0
            while True:
                loader.set_epoch(e)
                yield from loader
                e += 1
    it = batches()
    t0 = None
    for k in range(warmup + steps):
        if k == warmup:
            synchronize(device)
            t0 = time.perf_counter()
        x, y = next(it)
        with mp.autocast():
            loss = F.cross_entropy(model(x).float(), y % 10 if quick else y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    synchronize(device)
    it.close()
    return steps * cfg.batch_size / (time.perf_counter() - t0)


# --- small images: where the GPU pipeline loses, and what auto picks --------------------------
def small_images(root: Path, device: torch.device, workers: int, batch: int) -> dict:
    cfg = LoaderConfig(batch_size=batch, size=32, dtype=torch.bfloat16, channels_last=True, drop_last=True, num_workers=workers)
    rows = image_pipelines(root, cfg, device, workers, epochs=2)
    auto = data.ImageLoader(root, device=device, config=cfg, pipeline="auto", batch_size=batch, num_workers=workers)
    return {"rows": rows, "auto_choice": auto.pipeline, "auto_reason": auto.decision}


# --- tokenization ------------------------------------------------------------------------------
def tokenization(n_texts: int, workers: int, cache: Path) -> list[dict]:
    from overdrive.data.tokenize import local_corpus, train_local_tokenizer

    texts = local_corpus()
    texts = (texts * (n_texts // max(len(texts), 1) + 1))[:n_texts]
    tok = train_local_tokenizer(texts[:50_000], vocab_size=8000)
    rows = []
    t0 = time.perf_counter()
    ref = [tok.encode(t).ids for t in texts]
    naive = len(texts) / (time.perf_counter() - t0)
    rows.append({"method": "naive loop: tokenizer.encode(text) per sample [baseline]", "seq_per_s": naive})
    for label, kw in [("tokenize, in-process encode_batch", {"num_workers": 0}),
                      (f"tokenize, {workers} processes", {"num_workers": workers})]:
        t0 = time.perf_counter()
        out = data.tokenize(texts, tok, **kw)
        rows.append({"method": label, "seq_per_s": len(texts) / (time.perf_counter() - t0)})
        assert all(out[i] == ref[i] for i in range(0, len(texts), 101)), "tokenize output differs from encode()"
    data.tokenize(texts, tok, num_workers=0, cache_dir=cache)
    t0 = time.perf_counter()
    out = data.tokenize(texts, tok, num_workers=0, cache_dir=cache)
    assert out.from_cache
    rows.append({"method": "tokenize, from the disk cache", "seq_per_s": len(texts) / (time.perf_counter() - t0)})
    for r in rows:
        r["vs_naive"] = r["seq_per_s"] / naive
    return rows


# --- reporting ---------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if v != v else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}")
    return "-" if v is None else str(v)


def _table(rows: list[dict]) -> list[str]:
    cols = list(rows[0])
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, runs on CPU in about a minute")
    ap.add_argument("--images", type=int, default=None, help="dataset size (default 5000; quick 64)")
    ap.add_argument("--workers", type=int, default=None, help="CPU loader workers (default: CPU cores; quick 2)")
    ap.add_argument("--dir", default="/tmp/overdrive_data_bench", help="where the datasets are written")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    q = args.quick
    n = args.images or (64 if q else 5000)
    workers = args.workers or (2 if q else min(16, os.cpu_count() or 1))
    root = Path(args.dir)
    t_start = time.perf_counter()
    facts: dict[str, Any] = {**device_facts(device), "cpu_cores": os.cpu_count()}

    big, small = root / f"jpeg_{n}_{'quick' if q else 'full'}", root / f"small_{n}_{'quick' if q else 'full'}"
    t0 = time.perf_counter()
    size = (128, 96) if q else (500, 375)
    for d, sz in [(big, size), (small, (64, 48))]:
        if not (d / "done").exists():
            shutil.rmtree(d, ignore_errors=True)  # what an interrupted run left
            data.make_sample_dataset(d, n=n, size=sz, processes=workers)
            (d / "done").write_text("ok")
    facts["dataset_seconds"] = time.perf_counter() - t0
    nbytes = sum(p.stat().st_size for p in big.rglob("*.jpg"))
    facts["dataset"] = f"{n} JPEGs ~{size[0]}x{size[1]} q90 from scikit-image photos, mean {nbytes / n / 1e3:.0f} kB"
    print(f"dataset: {facts['dataset']} ({facts['dataset_seconds']:.1f} s)", flush=True)

    bs, S = (16, 64) if q else (256, 224)
    cfg = LoaderConfig(batch_size=bs, size=S, dtype=torch.bfloat16, channels_last=True, drop_last=True, num_workers=workers)
    pipes = image_pipelines(big, cfg, device, workers, epochs=2 if q else 3)
    print("\n".join(_table(pipes)), flush=True)

    steps, warm = (4, 2) if q else (30, 8)
    train = [{"feed": "synthetic (random bf16 batches on the device)", "img_per_s":
              train_throughput("synthetic", big, cfg, device, steps, warm, q, workers)}]
    feeds = (["gpu", "cpu"] if device.type == "cuda" else ["cpu"])
    for f in feeds:
        train.append({"feed": f"overdrive {f.upper()} pipeline", "img_per_s":
                      train_throughput(f, big, cfg, device, steps, warm, q, workers)})
    for r in train:
        r["vs_synthetic"] = r["img_per_s"] / train[0]["img_per_s"]
    print("\n".join(_table(train)), flush=True)

    smalls = small_images(small, device, workers, bs)
    print("\n".join(_table(smalls["rows"])), "\n", smalls["auto_reason"], flush=True)

    toks = tokenization(10_000 if q else 200_000, workers, root / "tok_cache")
    print("\n".join(_table(toks)), flush=True)
    facts["total_seconds"] = time.perf_counter() - t_start

    model = "a small CNN (quick mode)" if q else "ResNet-50 (torchvision, weights=None)"
    notes = [
        f"pipelines: batch {bs}, {S}x{S}, RandomResizedCrop(0.08-1, 3/4-4/3) + flip per sample, normalize, bf16 "
        f"channels_last on {device.type}; img/s over whole epochs after 2 warm-up batches, median of epochs.",
        f"training: {model}, overdrive.amp O2 bf16, channels_last, batch {bs}, {steps} steps after {warm} warm-up.",
        "small images: 64x48 JPEGs cropped to 32x32; auto measured both pipelines on this dataset.",
        f"total benchmark time {facts['total_seconds']:.0f} s (dataset creation {facts['dataset_seconds']:.0f} s).",
    ]
    name = "data_quick" if q else "data"
    md = ["## Image pipelines (read + decode + crop + flip + normalize)", "",
          *_table(pipes), "", "## Training fed by the pipeline vs synthetic data", "", *_table(train), "",
          "## Small images (where the GPU pipeline can lose)", "", *_table(smalls["rows"]), "",
          f"auto: **{smalls['auto_choice']}** ({smalls['auto_reason']})", "", "## Tokenization", "", *_table(toks)]
    jpath, _ = write_results(name, facts, notes=notes, body=md, extra={
        "pipelines": pipes, "training": train, "small_images": smalls, "tokenization": toks})
    print(f"wrote {jpath.with_suffix('')}.json/.md in {facts['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
