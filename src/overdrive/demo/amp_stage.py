"""Demo stage 1: train the digits CNN at O0-O3 and compare accuracy, loss, speed and memory."""

from __future__ import annotations

import copy

import torch

from overdrive.amp import Policy
from overdrive.demo.context import DemoContext
from overdrive.demo.models import DigitsCNN
from overdrive.demo.report import Table
from overdrive.train import Trainer


def train_digits(ctx: DemoContext, opt_level: str, epochs: int | None = None) -> tuple[torch.nn.Module, Trainer, object]:
    """Train a fresh DigitsCNN (same seed for every level) under ``opt_level``."""
    torch.manual_seed(ctx.seed)
    model = DigitsCNN().to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    train, test = ctx.digits.loaders(batch_size=ctx.batch_size, seed=ctx.seed)
    epochs = epochs or ctx.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=epochs * len(train))
    policy = Policy(opt_level=opt_level, dtype=ctx.dtype)
    trainer = Trainer(model, optimizer, policy=policy, device=ctx.device, scheduler=sched, progress=ctx.progress)
    result = trainer.fit(train, epochs=epochs, eval_data=test, description=f"{opt_level} train")
    return model, trainer, result


def run(ctx: DemoContext) -> Table:
    table = Table(
        f"Mixed precision (overdrive.amp) on digits, {ctx.device.type}, {str(ctx.dtype).removeprefix('torch.')} half",
        ["opt level", "test accuracy", "final train loss", "samples/s", "memory MiB", "speed vs O0", "skipped steps"],
    )
    base_tput = None
    for level in ctx.opt_levels:
        model, trainer, result = train_digits(ctx, level)
        last = result.history[-1]
        tput = result.samples_per_s
        base_tput = base_tput or (tput if level == "O0" else None)
        table.rows.append([
            level, last.eval_accuracy, result.final_loss, tput, result.peak_memory_mib,
            tput / base_tput if base_tput else float("nan"), sum(e.skipped_steps for e in result.history),
        ])
        if level == "O0":
            ctx.fp32_model = copy.deepcopy(model).eval()
            ctx.fp32_accuracy = last.eval_accuracy
    mem = "peak CUDA memory allocated" if ctx.device.type == "cuda" else "training state (params, grads, masters, optimizer state)"
    table.notes.append(f"memory: {mem}; samples/s excludes the first (warm-up) epoch; every level starts from the same seed.")
    if ctx.device.type == "cpu":
        from overdrive._utils.device import cpu_isa

        table.notes.append(
            f"CPU ISA {cpu_isa()}: without native bf16 (AVX512-BF16/AMX) torch emulates bf16 math, so half levels run "
            "slower here; mixed precision pays on tensor-core GPUs (see benchmarks/results/amp_train_resnet50.md and amp_train_gpt2.md)."
        )
    return table
