"""GPU speed of 2:4 sparsity: dense vs cuSPARSELt 2:4 Linear at transformer shapes, and an MLP block.

For each (tokens, in, out) and dtype: dense ``F.linear``; 2:4 ``F.linear`` on a
``to_sparse_semi_structured`` weight with cuSPARSELt's default algorithm; the same after
``torch._cslt_sparse_mm_search``; fp8 (e4m3) dense ``torch._scaled_mm`` vs ``torch._cslt_sparse_mm``
where torch supports it. Then ViT-B and BERT-L MLP blocks (Linear-GELU-Linear) dense vs exported
through ``overdrive.sparsity`` (forced sparse, and the auto rule that keeps dense where slower).
Medians of CUDA-event timings after warm-up, inputs rotated, random data (never zeros).

    python benchmarks/sparsity.py            # full, on the H200 (about 2 minutes)
    python benchmarks/sparsity.py --quick    # tiny shapes; on CPU only the dense path runs
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from overdrive.sparsity import SparsityConfig as Config, from_pruned, sparsify  # noqa: E402
from overdrive.sparsity.export import semi_structured_weight  # noqa: E402

sys.path.insert(0, str(ROOT))
from _common import device_facts, write_results  # noqa: E402

FULL_SHAPES = [(4096, 768, 3072), (4096, 3072, 768), (8192, 4096, 4096), (8192, 4096, 16384),
               (16384, 8192, 8192), (32768, 4096, 11008)]
QUICK_SHAPES = [(256, 128, 256), (256, 256, 128)]
DENSE_PEAK_TFLOPS = {"float16": 989.0, "bfloat16": 989.0, "float8_e4m3fn": 1979.0}  # H100/H200 SXM vendor dense peaks


def timed(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn(i)`` (i counts calls; callers rotate inputs with it)."""
    from overdrive._utils.timing import time_fn

    calls = itertools.count()
    return statistics.median(time_fn(lambda: fn(next(calls)), device, warmup=warmup, repeat=iters)) * 1e3


def pruned_weight(out_f: int, in_f: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    w = torch.randn(out_f, in_f, device=device) / in_f ** 0.5
    from overdrive.sparsity import compute_mask

    return (w * compute_mask(w)).to(dtype)


def inputs(tokens: int, in_f: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    n = max(1, min(4, (256 << 20) // (tokens * in_f * 2)))  # rotate when a set fits in L2 (50 MB)
    return [torch.randn(tokens, in_f, device=device).to(dtype) for _ in range(n)]


def bench_linear(shape, dtype, device, iters, warmup) -> dict:
    tokens, in_f, out_f = shape
    w = pruned_weight(out_f, in_f, dtype, device)
    xs = inputs(tokens, in_f, dtype, device)
    flops = 2 * tokens * in_f * out_f
    row = {"tokens": tokens, "in": in_f, "out": out_f, "dtype": str(dtype).removeprefix("torch.")}
    dense = timed(lambda i: F.linear(xs[i % len(xs)], w), device, iters, warmup)
    row["dense_ms"] = dense
    row["dense_tflops"] = flops / dense / 1e9
    if device.type != "cuda":
        row["note"] = "no GPU: dense only"
        return row
    try:
        sp0 = semi_structured_weight(w, None, search=False)
        ref = F.linear(xs[0].float(), w.float())
        out = F.linear(xs[0], sp0).float()
        row["rel_err"] = float((out - ref).norm() / ref.norm())
        row["sparse_default_ms"] = timed(lambda i: F.linear(xs[i % len(xs)], sp0), device, iters, warmup)
        t0 = time.perf_counter()
        sps = semi_structured_weight(w, xs[0], search=True)
        row["search_s"] = time.perf_counter() - t0
        row["alg_id"] = int(getattr(sps, "alg_id_cusparselt", 0))
        row["sparse_search_ms"] = timed(lambda i: F.linear(xs[i % len(xs)], sps), device, iters, warmup)
        row["speedup_default"] = dense / row["sparse_default_ms"]
        row["speedup_search"] = dense / row["sparse_search_ms"]
    except Exception as exc:  # report, do not hide
        row["note"] = f"sparse failed: {type(exc).__name__}: {str(exc)[:120]}"
    return row


def bench_fp8(shape, device, iters, warmup) -> dict:
    tokens, in_f, out_f = shape
    row = {"tokens": tokens, "in": in_f, "out": out_f, "dtype": "float8_e4m3fn"}
    try:
        w = pruned_weight(out_f, in_f, torch.float32, device).to(torch.float8_e4m3fn)
        xs = [x.to(torch.float8_e4m3fn) for x in inputs(tokens, in_f, torch.bfloat16, device)]
        one = torch.ones((), device=device)
        dense = timed(lambda i: torch._scaled_mm(xs[i % len(xs)], w.t(), one, one, out_dtype=torch.bfloat16),
                      device, iters, warmup)
        row["dense_ms"] = dense
        row["dense_tflops"] = 2 * tokens * in_f * out_f / dense / 1e9
        cw = torch._cslt_compress(w)
        # (out, in) sparse @ (in, tokens) dense -> (out, tokens); transpose_result gives (tokens, out)
        fn = lambda i: torch._cslt_sparse_mm(cw, xs[i % len(xs)].t(), out_dtype=torch.bfloat16, transpose_result=True)  # noqa: E731
        ref = (xs[0].float() @ w.float().t())
        out = fn(0).float()
        row["rel_err"] = float((out - ref).norm() / ref.norm())
        row["sparse_default_ms"] = timed(fn, device, iters, warmup)
        res = torch._cslt_sparse_mm_search(cw, xs[0].t())
        alg = int(res[0] if isinstance(res, (tuple, list)) else res)
        row["alg_id"] = alg
        fn2 = lambda i: torch._cslt_sparse_mm(cw, xs[i % len(xs)].t(), out_dtype=torch.bfloat16, transpose_result=True, alg_id=alg)  # noqa: E731
        row["sparse_search_ms"] = timed(fn2, device, iters, warmup)
        row["speedup_default"] = dense / row["sparse_default_ms"]
        row["speedup_search"] = dense / row["sparse_search_ms"]
    except Exception as exc:
        row["note"] = f"fp8 2:4 unsupported here: {type(exc).__name__}: {str(exc)[:120]}"
    return row


def bench_mlp(name, hidden, ffn, tokens, dtype, device, iters, warmup) -> dict:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)).to(device)
    handle = sparsify(mlp, Config())
    mlp = mlp.to(dtype).eval()
    xs = inputs(tokens, hidden, dtype, device)
    row = {"block": name, "tokens": tokens, "hidden": hidden, "ffn": ffn, "dtype": str(dtype).removeprefix("torch.")}
    with torch.no_grad():
        ref = mlp(xs[0]).float()
        row["dense_ms"] = timed(lambda i: mlp(xs[i % len(xs)]), device, iters, warmup)
        if device.type != "cuda":
            row["note"] = "no GPU: dense only"
            return row
        import copy

        for mode, min_speedup in (("forced", 0.0), ("auto", 1.0)):
            try:
                m2 = copy.deepcopy(mlp)
                h2 = from_pruned(m2)  # the copy carries the masks
                table = h2.export(tokens=tokens, min_speedup=min_speedup)
                out = m2(xs[0]).float()
                row[f"{mode}_rel_err"] = float((out - ref).norm() / ref.norm())
                row[f"{mode}_ms"] = timed(lambda i: m2(xs[i % len(xs)]), device, iters, warmup)
                row[f"{mode}_speedup"] = row["dense_ms"] / row[f"{mode}_ms"]
                row[f"{mode}_sparse_layers"] = sum(r[-1] == "sparse" for r in table.rows)
            except Exception as exc:  # report, do not hide
                row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    del handle
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few iterations (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    iters = args.iters or (5 if args.quick else 20)
    warmup = 2 if args.quick else 5
    dtypes = [torch.bfloat16] if device.type == "cpu" else [torch.float16, torch.bfloat16]
    t0 = time.perf_counter()
    linear = [bench_linear(s, dt, device, iters, warmup) for dt in dtypes for s in shapes]
    if device.type == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        linear += [bench_fp8(s, device, iters, warmup) for s in shapes]
    blocks = [("ViT-B MLP", 768, 3072), ("BERT-L MLP", 1024, 4096)]
    tok = 256 if args.quick else 16384
    mlps = [bench_mlp(n, h, f, tok, dt, device, iters, warmup) for dt in dtypes for n, h, f in blocks]
    meta = {**device_facts(device), "seconds": time.perf_counter() - t0,
            "cusparselt": bool(getattr(torch.backends, "cusparselt", None) and torch.backends.cusparselt.is_available())}
    name = "sparsity_quick" if args.quick else "sparsity"  # a smoke run never overwrites the committed results
    md = ["| tokens | in | out | dtype | dense ms | dense TFLOP/s | % dense peak | 2:4 default ms | 2:4 searched ms | speedup (default / searched) | rel err | note |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, p=3: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in linear:
        peak = DENSE_PEAK_TFLOPS.get(r["dtype"])
        pct = 100 * r["dense_tflops"] / peak if (peak and "dense_tflops" in r and device.type == "cuda") else None
        md.append(f"| {r['tokens']} | {r['in']} | {r['out']} | {r['dtype']} | {f(r.get('dense_ms'))} | "
                  f"{f(r.get('dense_tflops'), 1)} | {f(pct, 0)} | {f(r.get('sparse_default_ms'))} | {f(r.get('sparse_search_ms'))} | "
                  f"{f(r.get('speedup_default'), 2)} / {f(r.get('speedup_search'), 2)} | {f(r.get('rel_err'), 4)} | {r.get('note', '')} |")
    md += ["", "| block | tokens | dtype | dense ms | forced 2:4 ms (speedup) | auto ms (speedup, sparse layers) | note |",
           "|---|---|---|---|---|---|---|"]
    for r in mlps:
        md.append(f"| {r['block']} | {r['tokens']} | {r['dtype']} | {f(r['dense_ms'])} | "
                  f"{f(r.get('forced_ms'))} ({f(r.get('forced_speedup'), 2)}x) | "
                  f"{f(r.get('auto_ms'))} ({f(r.get('auto_speedup'), 2)}x, {r.get('auto_sparse_layers', '-')}) | {r.get('note', '')} |")
    notes = ["speedup = dense time / 2:4 time in the same run; > 1 means 2:4 is faster.",
             "'auto' keeps a layer dense unless its measured 2:4 time beats dense (export's min_speedup=1.0).",
             "% dense peak: against the vendor dense peak (989 TFLOP/s fp16/bf16, 1979 fp8)."]
    _, mpath = write_results(name, meta, notes=notes, body=md, extra={"linear": linear, "mlp": mlps},
                             title=f"2:4 sparsity speed ({meta['device']})", out_dir=args.out)
    print(mpath.read_text())
    print(f"total {meta['seconds']:.1f} s")


if __name__ == "__main__":
    main()
