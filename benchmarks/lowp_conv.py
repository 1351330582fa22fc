"""int8 / fp8 implicit-GEMM convolutions (overdrive::conv2d_q, Triton) against cuDNN fp16 at ResNet-50's shapes (GPU).

For each convolution shape of ResNet-50 whose input channels are a multiple of 16 (all but the 7x7 stem), at one
batch, in one run, every call captured in a CUDA graph and replayed (as an engine runs them):

- fp16 cudnn: the fp16 engine's path, cuDNN's fused convolution + bias (+ residual) + ReLU (``overdrive::conv2d_relu``);
- fp16 triton: ``overdrive::conv2d_q`` on the fp16 operands themselves (scale 1), the same epilogue, fp16 output;
- fp8 / int8 -> fp16: ``overdrive::conv2d_q`` with the same epilogue, fp16 output, input quantized already;
- fp8 / int8 -> q: the same with the next layer's quantize in the epilogue (one byte per output element);
- fp8 / int8 -> fp16+q (rows with a residual: a block's output): both at once (``overdrive::conv2d_q_dual``);
- fp8 / int8 -> q, q residual (rows with a residual): quantized output and an 8-bit residual
  (``BuildConfig.quantize_residuals``);
each with the kernel tiles tuned for the shape (``quant.conv.tune``), and the relative error of the Triton kernel
against the op's fp32 reference on the same quantized inputs (TF32 off), so a wrong kernel shows as an error, not
as a speed. ``x vs fp16`` = fp16 cudnn ms / ms (> 1: faster).

    python benchmarks/lowp_conv.py                   # H200: about 2 minutes
    python benchmarks/lowp_conv.py --batch 32 --out lowp_conv_bs32
Writes benchmarks/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, graphed_ms, write_results  # noqa: E402

# (in channels, out channels, kernel, stride, input size, residual add) of ResNet-50's convolutions (stem left out:
# 3 input channels), and how many times the network runs each
SHAPES = [(64, 64, 1, 1, 56, False, 1), (64, 64, 3, 1, 56, False, 3), (64, 256, 1, 1, 56, True, 3),
          (256, 64, 1, 1, 56, False, 2), (256, 128, 1, 1, 56, False, 1), (128, 128, 3, 2, 56, False, 1),
          (128, 512, 1, 1, 28, True, 4), (512, 128, 1, 1, 28, False, 3), (128, 128, 3, 1, 28, False, 3),
          (512, 256, 1, 1, 28, False, 1), (256, 256, 3, 2, 28, False, 1), (256, 1024, 1, 1, 14, True, 6),
          (1024, 256, 1, 1, 14, False, 5), (256, 256, 3, 1, 14, False, 5), (1024, 512, 1, 1, 14, False, 1),
          (512, 512, 3, 2, 14, False, 1), (512, 2048, 1, 1, 7, True, 3), (2048, 512, 1, 1, 7, False, 2),
          (512, 512, 3, 1, 7, False, 2)]



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="lowp_conv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lowp_conv.py times CUDA kernels: run it on a CUDA machine")
    from overdrive.engine import conv_fusion  # noqa: F401 - registers overdrive::conv2d_relu
    from overdrive.quant import conv as qconv

    torch.backends.cudnn.allow_tf32 = False  # the fp32 reference of the quantized op must be IEEE
    dev = torch.device("cuda")
    cl = torch.channels_last
    rows = []
    weighted = {"fp16 cudnn": 0.0, "fp16 triton": 0.0, "fp8 -> fp16": 0.0, "fp8 -> q": 0.0,
                "int8 -> fp16": 0.0, "int8 -> q": 0.0}
    flops_total = 0.0
    for cin, cout, k, stride, size, residual, count in SHAPES:
        torch.manual_seed(0)
        n, pad = args.batch, k // 2
        out_size = (size + 2 * pad - k) // stride + 1
        st, pd, dl = [stride] * 2, [pad] * 2, [1, 1]
        x = torch.randn(n, cin, size, size, device=dev, dtype=torch.half).contiguous(memory_format=cl)
        w = (torch.randn(cout, cin, k, k, device=dev, dtype=torch.half) / (cin * k * k) ** 0.5).contiguous(
            memory_format=cl)
        b = torch.randn(cout, device=dev, dtype=torch.half) * 0.1
        z = torch.randn(n, cout, out_size, out_size, device=dev, dtype=torch.half).contiguous(memory_format=cl) \
            if residual else None
        flops = 2.0 * n * out_size * out_size * cout * cin * k * k
        flops_total += flops * count
        row: dict = {"shape": f"{cin}->{cout} k{k} s{stride} @{size}{' +add' if residual else ''}", "count": count}

        def fp16(x=x, w=w, b=b, z=z, st=st, pd=pd):
            return torch.ops.overdrive.conv2d_relu(x, w, b, z, st, pd, dl, 1)

        times = {"fp16 cudnn": graphed_ms(fp16, dev, args.iters)}
        # the same Triton kernel on the fp16 operands themselves (scale 1): a fused fp16 path beside cuDNN's
        ones = torch.ones(cout, device=dev)
        cfg16, _ = qconv.tune(x, w, residual=residual, relu=True, out_dtype=torch.half, stride=st, padding=pd)

        def tri16(x=x, w=w, ones=ones, b=b, z=z, cfg=cfg16):
            return torch.ops.overdrive.conv2d_q(x, w, ones, b.float(), z, True, None, torch.half, -128, st, pd, dl, cfg)

        ref16 = qconv._reference(x, w, ones, b.float(), z, True, None, torch.half, -128, st, pd, dl)
        row["fp16 triton rel err"] = ((tri16().float() - ref16.float()).norm() / ref16.float().norm()).item()
        row["fp16 triton cfg"] = cfg16
        times["fp16 triton"] = graphed_ms(tri16, dev, args.iters)
        for fmt, dt, bound in (("fp8", qconv.FP8, 448.0), ("int8", torch.int8, 127.0)):
            xs = x.float().abs().amax() / bound
            xq = torch.ops.overdrive.quantize(x, xs, -128, fmt == "fp8")
            ws = w.float().abs().amax(dim=(1, 2, 3)) / bound
            wq = (w.float() / ws.view(-1, 1, 1, 1))
            wq = (wq.clamp(-448, 448).to(dt) if fmt == "fp8" else wq.round().clamp(-127, 127).to(dt)).contiguous(
                memory_format=cl)
            scale = (xs * ws).contiguous()
            bias = b.float()
            for out_q in (False, True):
                od = dt if out_q else torch.half
                osc = torch.tensor(0.05, device=dev) if out_q else None
                cfg, _ = qconv.tune(xq, wq, residual=residual, relu=True, out_dtype=od, stride=st, padding=pd)

                def run(xq=xq, wq=wq, scale=scale, bias=bias, z=z, osc=osc, od=od, cfg=cfg):
                    return torch.ops.overdrive.conv2d_q(xq, wq, scale, bias, z, True, osc, od, -128, st, pd, dl, cfg)

                label = f"{fmt} -> {'q' if out_q else 'fp16'}"
                out = run()
                ref = qconv._reference(xq, wq, scale, bias, z, True, osc, od, -128, st, pd, dl)
                if out_q:  # quantized outputs: the share of elements more than one step apart (rounding ties aside)
                    step = osc * (1 if fmt == "int8" else 32)
                    bad = ((out.float() - ref.float()).abs() > step).float().mean().item()
                    row[f"{label} bad"] = bad
                else:
                    row[f"{label} rel err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                times[label] = graphed_ms(run, dev, args.iters)
                row[f"{label} cfg"] = cfg
                if residual and not out_q:  # a block output: fp16 (the next residual) and quantized, one kernel
                    qs = torch.tensor(0.05, device=dev)

                    def dual(xq=xq, wq=wq, scale=scale, bias=bias, z=z, cfg=cfg, fp8=fmt == "fp8", qs=qs):
                        return torch.ops.overdrive.conv2d_q_dual(xq, wq, scale, bias, z, True, torch.half, qs, -128,
                                                                 fp8, st, pd, dl, cfg)

                    row[f"{fmt} -> fp16+q ms"] = graphed_ms(dual, dev, args.iters)
                if residual and out_q:  # the residual read 8-bit too (BuildConfig.quantize_residuals)
                    rs = torch.tensor(0.05, device=dev)
                    zq = torch.ops.overdrive.quantize(z, rs, -128, fmt == "fp8")

                    def qres(xq=xq, wq=wq, scale=scale, bias=bias, zq=zq, osc=osc, od=od, cfg=cfg, rs=rs):
                        return torch.ops.overdrive.conv2d_q(xq, wq, scale, bias, zq, True, osc, od, -128, st, pd, dl,
                                                            cfg, rs)

                    row[f"{fmt} -> q, q residual ms"] = graphed_ms(qres, dev, args.iters)
        for label, ms in times.items():
            row[f"{label} ms"] = ms
            weighted[label] += ms * count
        best = min(times[lbl] for lbl in ("fp8 -> q", "int8 -> q"))
        row["best q vs fp16"] = times["fp16 cudnn"] / best
        row["fp8 -> q TF/s"] = flops / times["fp8 -> q"] / 1e9
        row["fp16 TF/s"] = flops / times["fp16 cudnn"] / 1e9
        row["fp16 triton vs cudnn"] = times["fp16 cudnn"] / times["fp16 triton"]
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    notes = [f"batch {args.batch}, channels_last, CUDA-graph replays of 10 calls, median of {args.iters}; each row's "
             "kernel tiles tuned for it (config indexes in the cfg fields of the JSON); `best q vs fp16`: fp16 cudnn ms "
             "/ the faster of fp8 -> q and int8 -> q (> 1: faster)",
             "weighted totals (each shape times the number of times ResNet-50 runs it): "
             + ", ".join(f"{k} {v:.3f} ms ({weighted['fp16 cudnn'] / v:.2f}x fp16)" for k, v in weighted.items()),
             f"ResNet-50's convolutions (stem aside) are {flops_total / 1e12:.3f} TFLOP per batch: fp16 cudnn at "
             f"{flops_total / weighted['fp16 cudnn'] / 1e9:.0f} TF/s, fp8 -> q at "
             f"{flops_total / weighted['fp8 -> q'] / 1e9:.0f} TF/s, int8 -> q at "
             f"{flops_total / weighted['int8 -> q'] / 1e9:.0f} TOP/s",
             "rel err: ||triton - reference|| / ||reference|| against the op's fp32 reference on the same quantized "
             "inputs; bad: share of quantized outputs more than one quantization step from the reference"]
    cols = ["shape", "count", "fp16 cudnn ms", "fp16 triton ms", "fp16 triton vs cudnn", "fp8 -> fp16 ms", "fp8 -> q ms",
            "int8 -> fp16 ms", "int8 -> q ms", "fp8 -> fp16+q ms", "int8 -> fp16+q ms", "fp8 -> q, q residual ms",
            "int8 -> q, q residual ms", "best q vs fp16", "fp16 TF/s", "fp8 -> q TF/s", "fp8 -> fp16 rel err",
            "int8 -> fp16 rel err", "fp16 triton rel err", "fp8 -> q bad", "int8 -> q bad"]
    write_results(args.out, {**device_facts(dev), "batch": args.batch}, rows, cols, notes,
                  extra={"weighted_ms": weighted})


if __name__ == "__main__":
    main()
