"""Mixed-precision training throughput: hand-written PyTorch configs vs overdrive O1/O2/O3.

ResNet-50 (batch 256, synthetic images) and GPT-2 small (124M, B=32, T=1024, fused AdamW), one process,
every config timed the same way (CUDA events, median of the timed steps after warm-up).

    python benchmarks/amp_train.py            # full run on a CUDA GPU (about 7 minutes on an H200)
    python benchmarks/amp_train.py --quick    # tiny models on CPU, proves the script end to end
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_facts, median, time_steps, write_results  # noqa: E402
from gpt2 import GPT, GPTConfig, lm_loss  # noqa: E402

from overdrive import amp  # noqa: E402

PEAK_BF16 = 989e12  # H200/H100 SXM dense bf16, for MFU
RESNET50_TRAIN_FLOPS = 3 * 2 * 4.09e9  # 3x forward; forward = 4.09 GMAC per 224x224 image


@dataclass
class Cfg:
    name: str
    kind: str  # "hand" or "overdrive"
    dtype: torch.dtype | None = None  # autocast / half dtype; None = fp32
    tf32: bool = True
    opt_level: str | None = None
    compile: bool = False
    channels_last: bool = False


def resnet_configs(cuda: bool) -> list[Cfg]:
    cl = True
    cfgs = [
        Cfg("fp32 (tf32 off)", "hand", tf32=False),
        Cfg("tf32", "hand"),
        Cfg("autocast fp16 + GradScaler + CL", "hand", torch.float16, channels_last=cl),
        Cfg("autocast bf16 + CL", "hand", torch.bfloat16, channels_last=cl),
        Cfg("autocast bf16 + CL + compile", "hand", torch.bfloat16, channels_last=cl, compile=True),
        Cfg("O1 fp16 + CL", "overdrive", torch.float16, opt_level="O1", channels_last=cl),
        Cfg("O1 bf16 + CL", "overdrive", torch.bfloat16, opt_level="O1", channels_last=cl),
        Cfg("O2 fp16 + CL", "overdrive", torch.float16, opt_level="O2", channels_last=cl),
        Cfg("O2 bf16 + CL", "overdrive", torch.bfloat16, opt_level="O2", channels_last=cl),
        Cfg("O3 bf16 + CL", "overdrive", torch.bfloat16, opt_level="O3", channels_last=cl),
        Cfg("O2 bf16 + CL + compile", "overdrive", torch.bfloat16, opt_level="O2", channels_last=cl, compile=True),
        Cfg("O3 bf16 + CL + compile", "overdrive", torch.bfloat16, opt_level="O3", channels_last=cl, compile=True),
    ]
    return cfgs if cuda else [c for c in cfgs if c.dtype is not torch.float16 and c.tf32]


def gpt_configs(cuda: bool) -> list[Cfg]:
    cfgs = [
        Cfg("tf32", "hand"),
        Cfg("autocast bf16", "hand", torch.bfloat16),
        Cfg("autocast bf16 + compile", "hand", torch.bfloat16, compile=True),
        Cfg("O1 bf16", "overdrive", torch.bfloat16, opt_level="O1"),
        Cfg("O2 bf16", "overdrive", torch.bfloat16, opt_level="O2"),
        Cfg("O2 fp16 + compile", "overdrive", torch.float16, opt_level="O2", compile=True),
        Cfg("O2 bf16 + compile", "overdrive", torch.bfloat16, opt_level="O2", compile=True),
        Cfg("O3 bf16 + compile", "overdrive", torch.bfloat16, opt_level="O3", compile=True),
    ]
    return cfgs if cuda else [c for c in cfgs if c.dtype is not torch.float16]


def make_step(cfg: Cfg, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
              x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Callable[[], None]:
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    if cfg.kind == "hand":
        fwd = torch.compile(model) if cfg.compile else model
        scaler = torch.amp.GradScaler(device.type) if cfg.dtype is torch.float16 else None
        ctx: Callable[[], Any] = (lambda: torch.autocast(device.type, dtype=cfg.dtype)) if cfg.dtype else contextlib.nullcontext

        def hand_step() -> None:
            with ctx():
                loss = loss_fn(fwd(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)

        return hand_step

    mp = amp.prepare(model, opt, amp.Policy(opt_level=cfg.opt_level or "O1", dtype=cfg.dtype), device=device,
                     autocast_hooks=False)
    fwd = torch.compile(model) if cfg.compile else model

    def od_step() -> None:
        with mp.autocast():
            loss = loss_fn(fwd(x), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()

    return od_step


def bench_model(which: str, cfgs: list[Cfg], device: torch.device, quick: bool, warmup: int, iters: int) -> list[dict[str, Any]]:
    rows = []
    for cfg in cfgs:
        torch.manual_seed(0)
        if which == "resnet50":
            model, batch, flops_per_sample, unit = _resnet(quick), (8 if quick else 256), RESNET50_TRAIN_FLOPS, "img/s"
            model = model.to(device)
            x = torch.randn(batch, 3, 64 if quick else 224, 64 if quick else 224, device=device)
            y = torch.randint(0, 1000, (batch,), device=device)
            if cfg.channels_last:
                model = model.to(memory_format=torch.channels_last)
                x = x.contiguous(memory_format=torch.channels_last)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
            loss_fn = lambda out, t: nn.functional.cross_entropy(out.float(), t)  # noqa: E731
            per_step = batch
        else:
            c = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=512) if quick else GPTConfig()
            model = GPT(c).to(device)
            B, T = (2, 64) if quick else (32, 1024)
            data = torch.randint(0, c.vocab_size, (B, T + 1), device=device)
            x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
            opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                    fused=device.type == "cuda")
            loss_fn, per_step, unit = lm_loss, B * T, "tok/s"
            flops_per_sample = model.flops_per_token(T)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            step = make_step(cfg, model, opt, loss_fn, x, y, device)
            times = time_steps(step, device, warmup=warmup + (3 if cfg.compile else 0), iters=iters)
            t = median(times)
            tput = per_step / t
            row = {"model": which, "config": cfg.name, "kind": cfg.kind, "step_ms": t * 1e3, "throughput": tput,
                   "unit": unit, "mfu_pct": 100 * tput * flops_per_sample / PEAK_BF16 if device.type == "cuda" else None,
                   "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                   "spread_pct": 100 * (max(times) - min(times)) / t}
        except Exception as exc:  # a config that fails is reported, not hidden
            row = {"model": which, "config": cfg.name, "kind": cfg.kind, "error": f"{type(exc).__name__}: {exc}"[:300]}
        print(row, flush=True)
        rows.append(row)
        del model, opt
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    best_hand = max((r["throughput"] for r in rows if r["kind"] == "hand" and "throughput" in r), default=None)
    for r in rows:
        r["vs_best_hand"] = r["throughput"] / best_hand if best_hand and "throughput" in r else None
    return rows


def _resnet(quick: bool) -> nn.Module:
    try:
        import torchvision

        return torchvision.models.resnet18(num_classes=1000) if quick else torchvision.models.resnet50()
    except Exception:
        if not quick:
            raise
        return nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(16, 1000))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps (CPU smoke run)")
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--name", default=None, help="results file name (default amp_train, or amp_train_quick)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    warmup = args.warmup or (2 if args.quick else 8)
    iters = args.iters or (3 if args.quick else 20)
    rows: list[dict[str, Any]] = []
    for which in args.models.split(","):
        cfgs = resnet_configs(device.type == "cuda") if which == "resnet50" else gpt_configs(device.type == "cuda")
        rows += bench_model(which, cfgs, device, args.quick, warmup, iters)
    notes = [
        "throughput: median of timed steps (CUDA events) after warm-up; compile configs get 3 extra warm-up steps.",
        "vs_best_hand: throughput / best hand-written config of the same model in this run.",
        "MFU against 989 TFLOP/s dense bf16; ResNet-50 at 24.5 GFLOP/img (3x forward), GPT-2 at nanoGPT's 6N+12LdT.",
        "CL = channels_last; overdrive rows use overdrive.amp.prepare (the engine of amp.initialize) with TF32 on.",
    ]
    for which in dict.fromkeys(r["model"] for r in rows):
        od = [r for r in rows if r["model"] == which and r["kind"] == "overdrive" and r.get("vs_best_hand")]
        if od:
            best = max(od, key=lambda r: r["throughput"])
            notes.append(f"{which}: best overdrive config '{best['config']}' = {best['vs_best_hand']:.3f}x the best hand-written config.")
    cols = ["model", "config", "kind", "step_ms", "throughput", "unit", "mfu_pct", "peak_mem_gib", "vs_best_hand", "spread_pct", "error"]
    name = args.name or ("amp_train_quick" if args.quick else "amp_train")
    j, m = write_results(name, device_facts(device), rows, cols, notes)
    print(Path(m).read_text())


if __name__ == "__main__":
    main()
