"""Engines vs eager PyTorch: ResNet-50 and a BERT-base encoder (seq 128), batch 1 and 256, on one GPU.

For each model and batch: eager fp16 (the baseline, measured in the same run), then overdrive engines
(fp16, bf16; int8/fp8 when overdrive.quant is importable) built with the inductor backend. Times are
GPU compute medians of CUDA-event timings after warm-up over rotating inputs (no H2D/D2H, like
trtexec's "GPU Compute Time"); build time and load time are reported per engine, and one engine is
also loaded in a fresh process with an empty Inductor cache (what a deployment sees).

    python benchmarks/engine.py            # full: H200, about 5 minutes
    python benchmarks/engine.py --quick    # CPU smoke run: digits CNN, onnxruntime engine vs eager fp32
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from overdrive.demo.report import Table  # noqa: E402
from overdrive.engine import Builder, Engine, ShapeProfile  # noqa: E402

sys.path.insert(0, str(ROOT))
from _common import device_facts, write_results  # noqa: E402

# ResNet-50 MLPerf TensorRT per-GPU (H200, int8) and the targets, for the ceiling column.
MLPERF_RN50 = 94_600


def eager_time(fn: Callable, sets: list[tuple[torch.Tensor, ...]], device: torch.device, iters: int) -> list[float]:
    """Seconds per call (CUDA events on GPU, wall clock on CPU), rotating over input sets."""
    from overdrive._utils.timing import time_fn

    inputs = itertools.cycle(sets)
    with torch.inference_mode():
        return time_fn(lambda: fn(*next(inputs)), device, warmup=5, repeat=iters)


def resnet50() -> tuple[torch.nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]], list[str]]:
    import torchvision

    model = torchvision.models.resnet50(weights=None).eval()
    return model, (lambda b, seed: (torch.randn(b, 3, 224, 224, generator=torch.Generator().manual_seed(seed)),)), ["x"]


def bert_base() -> tuple[torch.nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]], list[str]]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig()).eval()

    def inputs(b: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 30522, (b, 128), generator=g), torch.ones(b, 128, dtype=torch.int64)

    return model, inputs, ["input_ids", "attention_mask"]


def digits() -> tuple[torch.nn.Module, Callable[[int, int], tuple[torch.Tensor, ...]], list[str]]:
    from overdrive.recipes.models import DigitsCNN

    torch.manual_seed(0)
    return DigitsCNN().eval(), (lambda b, seed: (torch.randn(b, 1, 8, 8, generator=torch.Generator().manual_seed(seed)),)), ["x"]


MODELS = {"resnet50": resnet50, "bert": bert_base, "digits": digits}


def cold_load(path: Path) -> dict[str, Any]:
    """Load + exec in a fresh process with an empty Inductor cache: the engine's own cache must carry it."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   PYTHONPATH=str(ROOT.parent / "src"))
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "overdrive.cli.main", "exec", "--load-engine", str(path),
                            "--duration", "1", "--no-data-transfers", "--json", "-"], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-500:]}
    s = json.loads(r.stdout)
    return {"load_s": s["load_s"], "process_s": wall, "compute_median_ms": s["compute_ms"]["median"],
            "load_compile": s.get("load_compile")}  # Inductor graph-cache hits / misses / bypasses in that load


def run(args: argparse.Namespace) -> list[Table]:
    device = torch.device(args.device)
    quant_ok = _quant_available()
    tables, records = [], []
    tmp = Path(tempfile.mkdtemp(prefix="od_engine_bench_"))
    cold_done = False
    for name in args.models:
        model, make, names = MODELS[name]()
        unit = "seq/s" if name == "bert" else "img/s"
        table = Table(f"{name} on {_device_name(device)}: engine vs eager",
                      ["batch", "config", f"throughput {unit}", "median ms", "p90 ms", "p99 ms", "vs eager", "build s", "load s"])
        for batch in args.batches:
            sets = [make(batch, s) for s in range(args.rotate)]
            dev_sets = [tuple(x.to(device) for x in s) for s in sets]
            base_dtype = torch.float16 if device.type == "cuda" else torch.float32
            eager = _eager(model, base_dtype, device, name == "resnet50")
            ts = eager_time(eager, dev_sets, device, args.iters)
            base = batch / statistics.median(ts)
            label = f"eager {'fp16' if base_dtype == torch.float16 else 'fp32'}"
            table.rows.append([batch, label, base, *_pcts(ts), 1.0, None, None])
            records.append({"model": name, "batch": batch, "config": label, "throughput": base, "times_ms": _pcts(ts)})
            del eager
            for prec in args.precisions:
                if time.perf_counter() - args.t_start > args.budget_s:
                    table.notes.append(f"{prec} batch {batch}: skipped, past the --budget-s {args.budget_s:.0f} s time budget")
                    continue
                if prec in ("int8", "fp8") and batch != max(args.batches) and not args.quick:
                    continue  # the int8/fp8 targets are throughput targets at the large batch; saves builds
                if prec in ("int8", "fp8") and not quant_ok:
                    table.notes.append(f"{prec}: skipped, overdrive.quant is not importable in this build")
                    continue
                static = [ShapeProfile.fixed(n, tuple(x.shape)) for n, x in zip(names, sets[0])]
                try:
                    t0 = time.perf_counter()
                    eng = Builder(precision=prec, device=str(device), backend=args.backend, profiles=static).build(
                        model, sets[0], input_names=names, calib=sets[:2])
                    build_s = time.perf_counter() - t0
                    path = tmp / f"{name}_{batch}_{prec}.engine"
                    eng.save(path)
                    loaded = Engine.load(path)
                    s = loaded.benchmark(inputs=None, duration_s=args.duration, iterations=args.iters, warmup_ms=200,
                                         no_data_transfers=True, percentiles=(90, 99))
                except Exception as exc:  # one failing config must not hide the others' numbers
                    table.notes.append(f"{prec} batch {batch}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                c = s["compute_ms"]
                tput = batch / (c["median"] / 1e3)
                cfg = f"engine {prec} ({loaded.info['backend']}, {loaded.header['backend_meta'].get('compile_mode', '-')})"
                table.rows.append([batch, cfg, tput, c["median"], c["p90"], c["p99"], tput / base, build_s, loaded.load_s])
                rec = {"model": name, "batch": batch, "config": cfg, "throughput": tput, "build_s": build_s,
                       "load_s": loaded.load_s, "summary": s}
                if device.type == "cuda" and not cold_done and not args.quick:
                    rec["cold_load"] = cold_load(path)
                    table.notes.append(f"fresh-process load of {path.name} with an empty Inductor cache: {rec['cold_load']}")
                    cold_done = True
                records.append(rec)
                del eng, loaded
                torch.compiler.reset()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if name == "resnet50" and device.type == "cuda":
            table.notes.append(f"ceiling: MLPerf Inference v4.1 TensorRT ResNet-50 offline int8 ~{MLPERF_RN50:,} img/s per H200")
        how = ("GPU compute medians (CUDA events) after warm-up, rotating inputs, no H2D/D2H" if device.type == "cuda" else
               "wall-clock medians per call after warm-up, rotating inputs; on a shared, loaded CPU eager PyTorch's "
               "intra-op threads suffer most from contention (see the load average)")
        table.notes.append(f"times: {how}; load s: Engine.load in the building process (Inductor's in-memory caches warm)")
        tables.append(table)
        print(table.to_markdown(), flush=True)
    tables[0].notes.append(f"raw records: {len(records)}")
    return tables, records


def _eager(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, channels_last: bool) -> Callable:
    import copy

    m = copy.deepcopy(model).to(device, dtype).eval()
    if channels_last and device.type == "cuda":
        m = m.to(memory_format=torch.channels_last)

    def fn(*xs: torch.Tensor) -> Any:
        xs = tuple(x.to(dtype) if x.is_floating_point() else x for x in xs)
        if channels_last and device.type == "cuda":
            xs = tuple(x.contiguous(memory_format=torch.channels_last) for x in xs)
        return m(*xs)
    return fn


def _pcts(ts: list[float]) -> list[float]:
    s = sorted(t * 1e3 for t in ts)
    return [statistics.median(s), s[int(0.9 * (len(s) - 1))], s[int(0.99 * (len(s) - 1))]]


def _quant_available() -> bool:
    try:
        from overdrive import quant  # noqa: F401

        return hasattr(quant, "quantize") and hasattr(quant, "to_real")
    except ImportError:
        return False


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: digits CNN, fp32, onnxruntime engine")
    ap.add_argument("--models", default=None, help="comma list of resnet50,bert,digits")
    ap.add_argument("--batches", default=None, help="comma list, default 1,256")
    ap.add_argument("--precisions", default=None, help="comma list, default fp16,bf16,int8,fp8")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--duration", type=float, default=None, help="seconds of engine timing per config")
    ap.add_argument("--rotate", type=int, default=3, help="distinct input sets to rotate over")
    ap.add_argument("--budget-s", type=float, default=300, help="skip configs that would start after this many seconds")
    ap.add_argument("--out", default=str(ROOT / "results" / "engine"))
    args = ap.parse_args()
    if args.quick:
        defaults = {"models": "digits", "batches": "1,64", "precisions": "fp32", "device": "cpu", "iters": 50, "duration": 0.5}
    else:
        defaults = {"models": "resnet50,bert", "batches": "1,256", "precisions": "fp16,bf16,int8,fp8",
                    "device": "cuda" if torch.cuda.is_available() else "cpu", "iters": 50, "duration": 1.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.models = args.models.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.precisions = args.precisions.split(",")
    t0 = args.t_start = time.perf_counter()
    tables, records = run(args)
    meta = {**device_facts(torch.device(args.device)), "device": _device_name(torch.device(args.device)),
            "wall_s": time.perf_counter() - t0, "load_average": os.getloadavg()[0], "cpu_cores": os.cpu_count()}
    out = Path(args.out + ("_quick" if args.quick else ""))
    jpath, _ = write_results(out.name, meta, tables=tables, extra={"records": records}, title="Engine benchmark",
                             out_dir=out.parent)
    print(f"wrote {jpath} and .md ({meta['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
