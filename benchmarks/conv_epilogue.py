"""Does cuDNN's fused convolution epilogue beat Inductor's convolution + Triton epilogue? (GPU only)

On the H200 the ResNet-50 fp16 engine spends its time in cuDNN convolutions, cuBLAS 1x1 GEMMs and
Inductor's separate bias+add+ReLU Triton passes (`engine_profile.md`); TensorRT fuses those passes into the
convolution. ATen exposes cuDNN's fused forms, `torch.cudnn_convolution_relu` (conv + bias + ReLU) and
`torch.cudnn_convolution_add_relu` (conv + bias + residual add + ReLU). This measures, for ResNet-50's
convolution shapes at batch 256 in fp16 channels_last, in the same run:

- eager: conv2d, then the bias/add/ReLU as separate kernels (plain PyTorch);
- compiled: torch.compile of the same function (Inductor: cuDNN convolution + one Triton epilogue pass);
- cudnn fused: the ATen cuDNN fused op, one call.

An engine pass that rewrites conv+BN(+add)+ReLU to the fused ops is worth building only if the fused column
wins over the compiled one on these shapes.

    python benchmarks/conv_epilogue.py           # H200: about 1 minute
Writes benchmarks/results/conv_epilogue.json and .md.
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

# (in channels, out channels, kernel, stride, input size, residual add) of ResNet-50's convolutions
SHAPES = [(3, 64, 7, 2, 224, False), (64, 64, 1, 1, 56, False), (64, 64, 3, 1, 56, False), (64, 256, 1, 1, 56, True),
          (256, 128, 1, 1, 56, False), (128, 128, 3, 2, 56, False), (128, 512, 1, 1, 28, True),
          (256, 256, 3, 1, 14, False), (256, 1024, 1, 1, 14, True), (512, 512, 3, 1, 7, False),
          (512, 2048, 1, 1, 7, True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("conv_epilogue.py times cuDNN kernels: run it on a CUDA machine")
    dev = torch.device("cuda")
    cl = torch.channels_last
    rows = []
    totals = {"eager": 0.0, "compiled": 0.0, "cudnn fused": 0.0}
    for cin, cout, k, stride, size, residual in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(args.batch, cin, size, size, device=dev, dtype=torch.half).contiguous(memory_format=cl)
        w = (torch.randn(cout, cin, k, k, device=dev, dtype=torch.half) / (cin * k * k) ** 0.5).contiguous(memory_format=cl)
        b = torch.randn(cout, device=dev, dtype=torch.half) * 0.1
        pad = k // 2
        out_size = (size + 2 * pad - k) // stride + 1
        z = torch.randn(args.batch, cout, out_size, out_size, device=dev, dtype=torch.half).contiguous(memory_format=cl)

        def eager(x=x, w=w, b=b, z=z, stride=stride, pad=pad, residual=residual):
            y = F.conv2d(x, w, b, stride, pad)
            return F.relu(y + z) if residual else F.relu(y)

        torch._dynamo.reset()  # one compile per shape: past dynamo's recompile limit it would run eager
        compiled = torch.compile(eager, dynamic=False)
        if residual:
            def fused(x=x, w=w, b=b, z=z, stride=stride, pad=pad):
                return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, [stride] * 2, [pad] * 2, [1, 1], 1)
        else:
            def fused(x=x, w=w, b=b, stride=stride, pad=pad):
                return torch.cudnn_convolution_relu(x, w, b, [stride] * 2, [pad] * 2, [1, 1], 1)
        row = {"shape": f"{cin}->{cout} k{k} s{stride} @{size}{' +add' if residual else ''}"}
        with torch.inference_mode():
            ref = eager()
            for label, fn in (("eager", eager), ("compiled", compiled), ("cudnn fused", fused)):
                try:
                    out = fn()
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = statistics.median(time_steps(fn, dev, warmup=5, iters=args.iters)) * 1e3
                except Exception as exc:  # a shape cuDNN's fused path refuses: say so, keep going
                    row[f"{label} ms"] = None
                    row["error"] = f"{label}: {type(exc).__name__}: {str(exc)[:160]}"
                    continue
                row[f"{label} ms"] = ms
                totals[label] += ms
                if label != "eager":
                    row[f"{label} max err"] = err
        if row.get("compiled ms") and row.get("cudnn fused ms"):
            row["fused vs compiled"] = row["compiled ms"] / row["cudnn fused ms"]
        rows.append(row)
        print(row, flush=True)
    notes = [f"batch {args.batch}, fp16 channels_last, CUDA-event medians of {args.iters} calls after 5 warm-up calls; "
             "fused vs compiled > 1 means cuDNN's fused op is faster",
             "totals over the shapes (each once, not weighted by how often ResNet-50 uses it): "
             + ", ".join(f"{k} {v:.2f} ms" for k, v in totals.items())]
    write_results("conv_epilogue", device_facts(dev), rows,
                  ["shape", "eager ms", "compiled ms", "cudnn fused ms", "fused vs compiled", "cudnn fused max err", "error"],
                  notes)


if __name__ == "__main__":
    main()
