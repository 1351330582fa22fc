"""Do sibling GEMMs (several Linears reading one input: Q/K/V, a gated MLP's gate and up) run faster as one GEMM
on the concatenated weight? (GPU only)

TensorRT fuses them ("horizontal fusion"); Inductor does not. For each shape, in the same run, fp16 and fp8:

- separate: one GEMM per sibling (``F.linear``; fp8: ``torch._scaled_mm`` on one quantized input);
- one GEMM: the weights concatenated once, one GEMM, the output split into the siblings' views.

Each under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs, as the engine runs), CUDA-event medians.
An engine pass that concatenates siblings is worth building only where the one-GEMM column wins.

    python benchmarks/gemm_siblings.py        # H200: about 1 minute
Writes benchmarks/results/gemm_siblings.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, time_steps, write_results  # noqa: E402

# (label, tokens M, in features K, the siblings' out features)
SHAPES = [("bert qkv bs32x128", 4096, 768, (768, 768, 768)), ("bert qkv bs1x128", 128, 768, (768, 768, 768)),
          ("vit-b qkv bs128", 128 * 197, 768, (768, 768, 768)), ("vit-b qkv bs1", 197, 768, (768, 768, 768)),
          ("llama-1024 qkv 16x512", 8192, 1024, (1024, 1024, 1024)), ("llama-1024 gate/up 16x512", 8192, 1024, (2816, 2816)),
          ("llama-1024 gate/up 1x512", 512, 1024, (2816, 2816)), ("llama-4096 gqa qkv 4x512", 2048, 4096, (4096, 1024, 1024))]


def _fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (t.abs().amax().float() / 448.0).clamp(min=1e-12)
    return (t / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_siblings.py times cuBLAS kernels: run it on a CUDA machine")
    dev = torch.device("cuda")
    rows = []
    for label, m, k, outs in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=torch.half)
        ws = [torch.randn(n, k, device=dev, dtype=torch.half) / k ** 0.5 for n in outs]
        bs = [torch.randn(n, device=dev, dtype=torch.half) * 0.1 for n in outs]
        wcat, bcat = torch.cat(ws), torch.cat(bs)
        q8 = [_fp8(w) for w in ws]
        scale_w = max(s for _, s in q8)  # one per-tensor weight scale for the concatenated weight
        w8cat = (wcat / scale_w).clamp(-448, 448).to(torch.float8_e4m3fn)
        sx = (x.abs().amax().float() / 448.0).clamp(min=1e-12)

        def sep16(x=x, ws=ws, bs=bs):
            return [F.linear(x, w, b) for w, b in zip(ws, bs)]

        def one16(x=x, wcat=wcat, bcat=bcat, outs=outs):
            return list(F.linear(x, wcat, bcat).split(list(outs), dim=-1))

        def sep8(x=x, q8=q8, bs=bs, sx=sx):
            xq = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
            return [torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=s, bias=b, out_dtype=torch.half)
                    for (w, s), b in zip(q8, bs)]

        def one8(x=x, w8cat=w8cat, scale_w=scale_w, bcat=bcat, sx=sx, outs=outs):
            xq = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(xq, w8cat.t(), scale_a=sx, scale_b=scale_w, bias=bcat, out_dtype=torch.half)
            return list(y.split(list(outs), dim=-1))

        row = {"shape": label, "M": m, "K": k, "N": "+".join(map(str, outs))}
        with torch.inference_mode():
            ref = torch.cat(sep16(), dim=-1).float()
            for name, fn in (("fp16 separate", sep16), ("fp16 one", one16), ("fp8 separate", sep8), ("fp8 one", one8)):
                c = torch.compile(fn, mode="reduce-overhead", dynamic=False)

                def step(c=c):
                    torch.compiler.cudagraph_mark_step_begin()
                    return c()

                try:
                    out = torch.cat([t.clone() for t in step()], dim=-1).float()
                    row[f"{name} ms"] = statistics.median(time_steps(step, dev, warmup=5, iters=args.iters)) * 1e3
                    row[f"{name} err"] = (out - ref).abs().max().item()
                except Exception as exc:
                    row["error"] = f"{name}: {type(exc).__name__}: {str(exc)[:160]}"
        for p in ("fp16", "fp8"):
            if row.get(f"{p} separate ms") and row.get(f"{p} one ms"):
                row[f"{p} one vs separate"] = row[f"{p} separate ms"] / row[f"{p} one ms"]
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    write_results("gemm_siblings", device_facts(dev), rows,
                  ["shape", "M", "K", "N", "fp16 separate ms", "fp16 one ms", "fp16 one vs separate", "fp8 separate ms",
                   "fp8 one ms", "fp8 one vs separate", "fp16 one err", "fp8 one err", "error"],
                  [f"fp16 inputs, CUDA-event medians of {args.iters} calls under torch.compile(mode='reduce-overhead'); "
                   "'one vs separate' > 1: the concatenated GEMM is faster",
                   "fp8: e4m3, per-tensor scales; the concatenated weight shares one scale (the largest of the siblings')",
                   "err: max abs difference from the fp16 separate GEMMs"])


if __name__ == "__main__":
    main()
