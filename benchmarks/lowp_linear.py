"""Transformer GEMMs with their epilogues: what an fp8 / int8 engine can gain per layer, and which kernel gains it (GPU).

For the Linear layers of the zoo's transformers (ViT-B/16 at batch 128, BERT-base at 32x128, the Llama-style decoder
at 16x512), at their token counts, in one run, every call captured in a CUDA graph and replayed (as an engine runs
them), with the layer's input quantized already (its quantize runs in the pass that makes it):

- fp16 cublas: the fp16 engine's path, ``addmm`` (``_addmm_activation`` with GELU where the layer's output goes
  through GELU: cuBLAS's GELU epilogue, the fp16 engine's GEMM+GELU fusion);
- fp8 scaled_mm (+ pass): the fp8 engine's current path, ``torch._scaled_mm`` writing fp16, then (GELU rows) one
  compiled pass for the GELU and the next layer's quantize, as Inductor fuses them;
- fp8 / int8 triton: ``overdrive::conv2d_q`` on the (tokens, K, 1, 1) view, the 1x1 implicit GEMM, tiles tuned per
  shape, with GELU and the next layer's quantize in its epilogue (GELU rows), fp16 out otherwise;
- int8 int_mm (+ pass): ``torch._int_mm`` and one compiled pass for the rescale (+ GELU + quantize).
Each low-precision output is checked against the op's fp32 reference on the same quantized inputs (rel err), so a
wrong kernel shows as an error, not as a speed. ``x`` columns: fp16 cublas ms / ms (> 1: faster).

    python benchmarks/lowp_linear.py              # H200: about 2 minutes
Writes benchmarks/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, graphed_ms, write_results  # noqa: E402

# (model, tokens, K, N, epilogue, layers per forward): epilogue "gelu" = GELU then the next layer's quantize
SHAPES = [("vit-b bs128", 128 * 197, 768, 2304, None, 12), ("vit-b bs128", 128 * 197, 768, 768, None, 12),
          ("vit-b bs128", 128 * 197, 768, 3072, "gelu", 12), ("vit-b bs128", 128 * 197, 3072, 768, None, 12),
          ("bert 32x128", 32 * 128, 768, 2304, None, 12), ("bert 32x128", 32 * 128, 768, 768, None, 12),
          ("bert 32x128", 32 * 128, 768, 3072, "gelu", 12), ("bert 32x128", 32 * 128, 3072, 768, None, 12),
          ("llama 16x512", 16 * 512, 1024, 3072, None, 8), ("llama 16x512", 16 * 512, 1024, 1024, None, 8),
          ("llama 16x512", 16 * 512, 1024, 5632, None, 8), ("llama 16x512", 16 * 512, 2816, 1024, None, 8)]



def _fp8_epilogue(y: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return (F.gelu(y.float()) / qs).clamp(-448, 448).to(torch.float8_e4m3fn)


def _int8_epilogue(acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, qs: torch.Tensor | None) -> torch.Tensor:
    y = acc.float() * scale + bias
    if qs is None:
        return y.half()
    return torch.round(F.gelu(y) / qs).clamp(-128, 127).to(torch.int8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--models", default="", help="comma-separated prefixes of the model column (default: all)")
    ap.add_argument("--out", default="lowp_linear")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lowp_linear.py times CUDA kernels: run it on a CUDA machine")
    from overdrive.quant import conv as qconv

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False  # the fp32 reference of the quantized op must be IEEE
    dev = torch.device("cuda")
    fp8_pass = torch.compile(_fp8_epilogue, dynamic=False)
    int8_pass = torch.compile(_int8_epilogue, dynamic=False)
    geo = ([1, 1], [0, 0], [1, 1])
    rows = []
    weighted: dict[str, dict[str, float]] = {}
    wanted = [m for m in args.models.split(",") if m]
    for model, m_rows, k, n, epi, count in SHAPES:
        if wanted and not any(model.startswith(w) for w in wanted):
            continue
        torch.manual_seed(0)
        gelu = epi == "gelu"
        x = torch.randn(m_rows, k, device=dev, dtype=torch.half)
        w = torch.randn(n, k, device=dev, dtype=torch.half) / k ** 0.5
        b = torch.randn(n, device=dev, dtype=torch.half) * 0.1
        flops = 2.0 * m_rows * k * n
        row: dict = {"model": model, "gemm": f"{m_rows}x{k}->{n}{' gelu->q' if gelu else ''}", "count": count}
        times: dict[str, float] = {}
        wt = w.t()
        if gelu:
            times["fp16 cublas"] = graphed_ms(lambda: torch._addmm_activation(b, x, wt, use_gelu=True), dev, args.iters)
        else:
            times["fp16 cublas"] = graphed_ms(lambda: torch.addmm(b, x, wt), dev, args.iters)
        y_ref = F.linear(x.float(), w.float(), b.float())
        qs_val = (F.gelu(y_ref).abs().amax() if gelu else y_ref.abs().amax()).reshape(())
        for fmt, dt, bound in (("fp8", qconv.FP8, 448.0), ("int8", torch.int8, 127.0)):
            xs = (x.float().abs().amax() / bound).reshape(())
            xq = torch.ops.overdrive.quantize(x, xs, -128, fmt == "fp8")
            ws = w.float().abs().amax(dim=1) / bound
            if fmt == "fp8":
                ws_t = ws.max()  # per-tensor weight scale, as _scaled_mm's per-tensor path takes it
                wq = (w.float() / ws_t).clamp(-448, 448).to(dt)
                scale = (xs * ws_t).expand(n).contiguous()
            else:
                wq = (w.float() / ws.view(-1, 1)).round().clamp(-127, 127).to(dt)
                scale = (xs * ws).contiguous()
            qs = (qs_val / bound).float()
            bias = b.float()
            # the cuBLAS path: _scaled_mm / _int_mm, then one compiled pass
            if fmt == "fp8":
                wt8 = wq.t()

                def lib(xq=xq, wt8=wt8, xs=xs, ws_t=ws_t, qs=qs):
                    y = torch._scaled_mm(xq, wt8, scale_a=xs, scale_b=ws_t, bias=b, out_dtype=torch.half)
                    return fp8_pass(y, qs) if gelu else y

            else:
                wti = wq.t()

                def lib(xq=xq, wti=wti, scale=scale, bias=bias, qs=qs):
                    return int8_pass(torch._int_mm(xq, wti), scale, bias, qs if gelu else None)

            times[f"{fmt} {'scaled_mm' if fmt == 'fp8' else 'int_mm'}"] = graphed_ms(lib, dev, args.iters)
            # the Triton implicit GEMM on the 1x1 view, epilogue fused
            x4, w4 = xq.view(m_rows, k, 1, 1), wq.view(n, k, 1, 1)
            od = dt if gelu else torch.half
            osc = qs if gelu else None
            act = qconv.ACT_GELU if gelu else 0
            cfg, _ = qconv.tune(x4, w4, out_dtype=od)

            def tri(x4=x4, w4=w4, scale=scale, bias=bias, osc=osc, od=od, cfg=cfg, act=act):
                return torch.ops.overdrive.conv2d_q(x4, w4, scale, bias, None, False, osc, od, -128, *geo, cfg, None,
                                                    act)

            out = tri()
            ref = qconv._reference(x4, w4, scale, bias, None, False, osc, od, -128, *geo, None, act)
            if gelu:
                step = qs * (1 if fmt == "int8" else 32)
                row[f"{fmt} triton bad"] = ((out.float() - ref.float()).abs() > step).float().mean().item()
            else:
                row[f"{fmt} triton rel err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row[f"{fmt} triton cfg"] = cfg
            times[f"{fmt} triton"] = graphed_ms(tri, dev, args.iters)
        for label, ms in times.items():
            row[f"{label} ms"] = ms
            row[f"{label} x"] = times["fp16 cublas"] / ms
            weighted.setdefault(model, {}).setdefault(label, 0.0)
            weighted[model][label] += ms * count
        row["fp16 TF/s"] = flops / times["fp16 cublas"] / 1e9
        row["fp8 triton TF/s"] = flops / times["fp8 triton"] / 1e9
        row["fp8 scaled_mm TF/s"] = flops / times["fp8 scaled_mm"] / 1e9
        rows.append(row)
        print({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    notes = [f"every call replayed from a CUDA graph of 10 calls, median of {args.iters}; inputs quantized already; "
             "Triton tiles tuned per row (cfg fields in the JSON); x = fp16 cublas ms / ms (> 1: faster)",
             "per model, the Linear layers of one forward (each row times its count): " + "; ".join(
                 f"{mdl}: " + ", ".join(f"{lbl} {ms:.3f} ms ({tot['fp16 cublas'] / ms:.2f}x)" for lbl, ms in tot.items())
                 for mdl, tot in weighted.items()),
             "rel err: ||kernel - reference|| / ||reference|| against the op's fp32 reference on the same quantized "
             "inputs; bad: share of quantized outputs more than one quantization step from the reference"]
    cols = ["model", "gemm", "count", "fp16 cublas ms", "fp8 scaled_mm ms", "fp8 scaled_mm x", "fp8 triton ms",
            "fp8 triton x", "int8 int_mm ms", "int8 int_mm x", "int8 triton ms", "int8 triton x", "fp16 TF/s",
            "fp8 scaled_mm TF/s", "fp8 triton TF/s", "fp8 triton rel err", "int8 triton rel err", "fp8 triton bad",
            "int8 triton bad"]
    write_results(args.out, device_facts(dev), rows, cols, notes, extra={"weighted_ms": weighted})


if __name__ == "__main__":
    main()
