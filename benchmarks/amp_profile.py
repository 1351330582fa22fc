"""Where a GPT-2 small training step spends its GPU time under overdrive O2 bf16 + torch.compile.

Profiles a few steps with torch.profiler after warm-up, groups CUDA kernels into matmul, attention,
fused elementwise (Triton), optimizer and copies, and reports achieved matmul TFLOP/s against the
bf16 ceiling, to explain the gap between the measured MFU and the 50% target.

    python benchmarks/amp_profile.py            # on a CUDA GPU (about 1.5 minutes on an H200)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_facts, write_results  # noqa: E402
from gpt2 import GPT, GPTConfig, lm_loss  # noqa: E402

from overdrive import amp  # noqa: E402

CATEGORIES = (  # first match wins; kernel names of cuBLAS/CUTLASS, flash attention, Inductor, optimizers
    ("matmul (cuBLAS/CUTLASS)", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("attention (SDPA flash)", ("flash", "fmha", "attention")),
    ("optimizer (fused AdamW, foreach)", ("adam", "multi_tensor", "foreach")),
    ("copies / casts", ("copy", "memcpy", "memset", "cast")),
    ("cross-entropy / softmax", ("softmax", "cross_entropy", "nll", "log_softmax")),
    ("fused elementwise (Triton)", ("triton",)),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU (smoke run)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    c = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512) if args.quick else GPTConfig()
    B, T = (2, 64) if args.quick else (32, 1024)
    model = GPT(c).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16), device=device, autocast_hooks=False)
    fwd = torch.compile(model)
    data = torch.randint(0, c.vocab_size, (B, T + 1), device=device)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step() -> None:
        loss = lm_loss(fwd(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()

    for _ in range(8):
        step()
    wall_ms = float("nan")
    if device.type == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            step()
        b.record()
        b.synchronize()
        wall_ms = a.elapsed_time(b) / 5
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    by_cat: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if device.type == "cuda" and evt.device_type == torch.autograd.DeviceType.CUDA:
            us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            by_cat[category(evt.name)] += us
            kernels[evt.name] += us
    total_us = sum(by_cat.values()) or 1.0
    per_step_ms = total_us / args.steps / 1e3
    flops_step = model.flops_per_token(T) * B * T
    mm_ms = by_cat.get("matmul (cuBLAS/CUTLASS)", 0.0) / args.steps / 1e3
    rows = [{"category": k, "ms_per_step": v / args.steps / 1e3, "share_pct": 100 * v / total_us}
            for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    notes = [
        f"step time {wall_ms:.1f} ms (CUDA events, 5 steps, no profiler); the rest of this table is from the profiler.",
        f"GPU kernel time per step {per_step_ms:.1f} ms (sum of kernel durations over {args.steps} profiled steps).",
        f"model FLOPs per step {flops_step / 1e12:.2f} TFLOP (6N + 12LdT per token): at kernel-time {flops_step / (per_step_ms / 1e3) / 1e12:.0f} TFLOP/s = "
        f"{100 * flops_step / (per_step_ms / 1e3) / 989e12:.1f}% MFU.",
        f"matmul kernels {mm_ms:.1f} ms/step: if all model FLOPs but attention's ran there, "
        f"{(6 * model.num_params() * B * T) / (mm_ms / 1e3) / 1e12 if mm_ms else 0:.0f} TFLOP/s (bf16 ceiling measured ~765).",
        "top kernels: " + "; ".join(f"{n[:70]} {t / args.steps / 1e3:.2f} ms" for n, t in top),
    ]
    for n in notes:
        print(n)
    for r in rows:
        print(r)
    write_results("amp_profile_gpt2", device_facts(device), rows, ["category", "ms_per_step", "share_pct"], notes)


if __name__ == "__main__":
    main()
