"""Per-step overhead of overdrive's Trainer against the hand-written loop, on a model small enough that the
overhead is the step: ResNet-18's structure (62 parameters, BatchNorm, channels_last) at width 4 on 8x8 images.

For each opt level: steps/s of ``Trainer.fit`` and of the plain-PyTorch loop the demo compares it with
(autocast + GradScaler, channels_last, AdamW fused where torch has it, torch.compile with ``--compile``), both
over the epochs after the first and with the same model, optimizer, schedule and batches; and the host reads
(``.item()``, ``float(t)``, ``.tolist()``, ...) each makes per step. On a GPU a host read waits for every queued
kernel; GradScaler with a fused optimizer makes none (the optimizer skips an inf/NaN step on the device).

    python benchmarks/train_overhead.py                     # CPU, bf16, eager
    python benchmarks/train_overhead.py --compile           # + torch.compile (about a minute per level on 2 cores)
    python benchmarks/train_overhead.py --device cuda       # fp16
    python benchmarks/train_overhead.py --device cuda --compile --model demo --levels O2 --steps 11 --epochs 6
        # the demo's amp workload (ResNet-18, 1x224x224, batch 128, 11 steps an epoch) where Trainer O2 + compile
        # ran 0.74-0.84x the hand loop; the "hand + 1 read" column is the hand loop with one host read of a
        # device flag per step (where overdrive's dynamic loss scale reads its inf/NaN flag): what one sync costs

Writes benchmarks/results/train_overhead_<device>[_compile].json and .md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.timing import count_host_reads
from overdrive.amp import Policy
from overdrive.recipes.models import ResNet
from overdrive.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_facts, write_results  # noqa: E402


def make(dev: torch.device, kind: str = "tiny") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if kind == "demo":  # the demo's amp workload model (ResNet-18, one input channel)
        from overdrive.demo.workloads import choose_workload

        model = choose_workload(torch.device("cuda"), quick=False).make_model()
    else:
        model = ResNet(width=4, stem="small")
    model = model.to(dev).to(memory_format=torch.channels_last)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, fused=True)


def hand(level: str, data: list[Any], args: argparse.Namespace, dev: torch.device, half: torch.dtype,
         sync: bool = False) -> dict[str, Any]:
    """The hand-written loop; ``sync``: plus one host read of a device flag per step, after the backward."""
    model, opt = make(dev, args.model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=args.epochs * len(data))
    scaler = torch.amp.GradScaler(dev.type, enabled=half == torch.float16 and level != "O0")
    fwd = torch.compile(model) if args.compile else model
    rates, reads = [], 0

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(dev.type, dtype=half, enabled=level != "O0"):
            loss = nn.functional.cross_entropy(fwd(x).float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if sync:
            bool(torch.isfinite(loss))  # a host read: waits for the backward, as a loss-scale flag read does
        scaler.step(opt)
        scaler.update()
        sched.step()
        return loss.detach()

    for epoch in range(args.epochs):
        model.train()
        t0 = time.perf_counter()
        with count_host_reads() as n:
            losses = [step(x, y) for x, y in data]
        float(torch.stack(losses).mean())
        rates.append(len(data) / (time.perf_counter() - t0))
        reads = n["reads"]
    return {"steps_per_s": sum(rates[1:]) / len(rates[1:]), "reads_per_step": reads / len(data)}


def trainer(level: str, data: list[Any], args: argparse.Namespace, dev: torch.device, half: torch.dtype,
            defer: bool = True) -> dict[str, Any]:
    """``defer=False``: the inf/NaN checks read on the host every step (the Trainer's CPU default; its CUDA
    default before checks were deferred)."""
    model, opt = make(dev, args.model)
    # one warm-up epoch, one counted epoch, then the timed ones
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=(args.epochs + 1) * len(data))
    t = Trainer(model, opt, policy=Policy(opt_level=level, dtype=half), scheduler=sched, progress=False,
                compile=args.compile, channels_last=True)
    t.mp.defer_checks(defer)
    t.fit(data, epochs=1)
    with count_host_reads() as n:
        for b in data:
            t.train_step(b)
    r = t.fit(data, epochs=args.epochs - 1)  # epochs after the first, as hand(): fit's own first one is warm
    return {"steps_per_s": sum(len(data) / e.seconds for e in r.history) / len(r.history),
            "reads_per_step": n["reads"] / len(data)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--levels", default="O0,O1,O2")
    ap.add_argument("--steps", type=int, default=100, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--model", choices=["tiny", "demo"], default="tiny",
                    help="tiny: ResNet-18's structure at width 4 on 8x8 images, batch 8 (the host's work is the step); "
                         "demo: the demo's ResNet-18 on 1x224x224 images, batch 128 (GPU work and host work alike)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    half = torch.float16 if dev.type == "cuda" else torch.bfloat16
    if dev.type == "cpu":
        torch.set_num_threads(1)  # one core: the host's work per step, not how well the tiny kernels spread
    g = torch.Generator().manual_seed(0)
    batch, size = (128, 224) if args.model == "demo" else (8, 8)
    data = [(torch.randn(batch, 1, size, size, generator=g).to(dev), torch.randint(0, 10, (batch,), generator=g).to(dev))
            for _ in range(args.steps)]
    rows = []
    for level in args.levels.split(","):
        torch._dynamo.reset()
        h = hand(level, data, args, dev, half)
        torch._dynamo.reset()
        hs = hand(level, data, args, dev, half, sync=True)
        torch._dynamo.reset()
        t = trainer(level, data, args, dev, half)
        torch._dynamo.reset()
        ts = trainer(level, data, args, dev, half, defer=False)
        rows.append({"level": level, "hand_steps_per_s": h["steps_per_s"], "trainer_steps_per_s": t["steps_per_s"],
                     "trainer_vs_hand": t["steps_per_s"] / h["steps_per_s"],
                     "trainer_sync_vs_hand": ts["steps_per_s"] / h["steps_per_s"],
                     "hand_1read_vs_hand": hs["steps_per_s"] / h["steps_per_s"],
                     "extra_ms_per_step": 1e3 / t["steps_per_s"] - 1e3 / h["steps_per_s"],
                     "hand_reads_per_step": h["reads_per_step"], "trainer_reads_per_step": t["reads_per_step"]})
        print(rows[-1], flush=True)
    name = f"train_overhead_{dev.type}" + ("_compile" if args.compile else "") + ("_demo" if args.model == "demo" else "")
    what = ("the demo's ResNet-18 (width 64), 1x224x224 images, batch 128" if args.model == "demo" else
            "ResNet-18 structure at width 4 (62 parameters), 8x8 images, batch 8")
    notes = [f"{what}, {args.steps} steps per epoch, "
             f"{args.epochs} epochs, steps/s over the epochs after the first; {half} half; AdamW(fused=True); "
             f"compile={args.compile}. Host reads per step count every read of a tensor's value into Python "
             "(on the CPU, non-fused optimizers' step counters are such reads too). hand_1read_vs_hand: the hand loop "
             "with one host read of a device flag per step (after the backward) against the same loop without it; "
             "trainer_sync_vs_hand: the Trainer with its inf/NaN checks read on the host every step (defer_checks(False)); "
             "trainer_vs_hand: with them deferred (defer_checks(), the CUDA default; on the CPU it changes nothing "
             "measurable, the CPU works in order)."]
    write_results(name, {**device_facts(dev), "compile": args.compile}, rows,
                  ["level", "hand_steps_per_s", "trainer_steps_per_s", "trainer_vs_hand", "trainer_sync_vs_hand",
                   "hand_1read_vs_hand", "extra_ms_per_step",
                   "hand_reads_per_step", "trainer_reads_per_step"], notes)


if __name__ == "__main__":
    main()
