"""Demo stage 1: train the workload's model at O0-O3 and compare accuracy, loss, speed and memory, against
fp32 (O0) and against the best hand-written plain-PyTorch loop (autocast + channels_last + torch.compile)
measured in the same run."""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

from overdrive._utils.errors import OverdriveError
from overdrive.amp import Policy
from overdrive.demo.context import DemoContext
from overdrive._utils.table import Table
from overdrive.demo.workloads import DeviceBatches
from overdrive.train import Trainer, evaluate


def batches(ctx: DemoContext, seed: int | None = None) -> tuple[Any, Any]:
    """(train, test) batches of the workload's data: on a GPU the whole set lives on the device."""
    d, w = ctx.data, ctx.workload
    seed = ctx.seed if seed is None else seed
    if ctx.device.type == "cuda":
        key = f"_device_data_{w.image_size}"
        if key not in ctx.artifacts:
            ctx.artifacts[key] = tuple(t.to(ctx.device) for t in (d.x_train, d.y_train, d.x_test, d.y_test))
        xtr, ytr, xte, yte = ctx.artifacts[key]
        return (DeviceBatches(xtr, ytr, w.batch_size, seed=seed),
                DeviceBatches(xte, yte, 256, shuffle=False, drop_last=False))
    return d.loaders(batch_size=w.batch_size, seed=seed)


def train_digits(ctx: DemoContext, opt_level: str, epochs: int | None = None, compile: bool = False,
                 channels_last: bool = False) -> tuple[torch.nn.Module, Trainer, Any]:
    """Train a fresh workload model (same seed for every level) under ``opt_level``.

    Returns (model, trainer, result); ``result.curve`` holds the per-epoch training loss and
    ``result.diverged`` the epoch a non-finite loss ended the run in (None when it finished)."""
    torch.manual_seed(ctx.seed)
    model = ctx.workload.make_model().to(ctx.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    # fused AdamW on CUDA, as the hand-written baseline uses (one kernel for every parameter's update)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.workload.lr, weight_decay=1e-4,
                                  fused=ctx.device.type == "cuda")
    train, test = batches(ctx)
    epochs = epochs or ctx.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=ctx.workload.lr, total_steps=epochs * len(train))
    policy = Policy(opt_level=opt_level, dtype=ctx.dtype)
    trainer = Trainer(model, optimizer, policy=policy, device=ctx.device, scheduler=sched, progress=ctx.progress,
                      compile=compile, channels_last=channels_last)
    curve: list[float] = []
    try:
        result = trainer.fit(train, epochs=epochs, eval_data=test, description=f"{opt_level} train",
                             on_epoch_end=lambda s: curve.append(s.loss))
        result.diverged = None
    except OverdriveError as exc:
        if "diverged" not in str(exc):
            raise
        curve.append(math.nan)
        result = _Diverged(trainer.epoch)
    result.curve = curve
    return model, trainer, result


class _Diverged:
    def __init__(self, epoch: int) -> None:
        self.diverged = epoch
        self.history: list[Any] = []


def handwritten(ctx: DemoContext, compile: bool) -> dict[str, Any]:
    """The plain-PyTorch loop a careful user writes by hand, no overdrive in it: channels_last, autocast in
    the half dtype (GradScaler for fp16), fused AdamW on CUDA, the same schedule and batches, and
    ``torch.compile`` of the model when ``compile``. Timed as Trainer.fit times (epochs after the first)."""
    torch.manual_seed(ctx.seed)
    dev, w = ctx.device, ctx.workload
    model = w.make_model().to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=1e-4, fused=dev.type == "cuda")
    train, test = batches(ctx)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=w.lr, total_steps=ctx.epochs * len(train))
    scaler = torch.amp.GradScaler(dev.type, enabled=ctx.dtype == torch.float16)
    fwd = torch.compile(model) if compile else model
    curve, seconds, samples, rates = [], 0.0, 0, []
    for epoch in range(ctx.epochs):
        losses = []
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        t0 = time.perf_counter()
        model.train()
        for x, y in train:
            x = x.to(dev, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=ctx.dtype):
                loss = torch.nn.functional.cross_entropy(fwd(x).float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.detach())
        curve.append(float(torch.stack(losses).mean()))
        if epoch > 0 or ctx.epochs == 1:
            took = time.perf_counter() - t0
            seconds += took
            samples += len(train) * w.batch_size
            rates.append(len(train) * w.batch_size / max(took, 1e-9))
    acc = evaluate(model.eval(), test)[1]
    return {"accuracy": acc, "samples_per_s": samples / max(seconds, 1e-9), "curve": curve, "final_loss": curve[-1],
            "epoch_rates": rates}


def epoch_spread(rates: list[float]) -> str | None:
    """The slowest and the fastest timed epoch, as samples/s: the spread beside a throughput (one run on a shared
    machine moves by tens of percent between runs).

    Example:
        >>> epoch_spread([812.4, 1190.0, 1003.2]), epoch_spread([])
        ('812-1,190', None)
    """
    if not rates:
        return None
    return f"{min(rates):,.0f}-{max(rates):,.0f}"


def run(ctx: DemoContext) -> Table:
    w, half = ctx.workload, str(ctx.dtype).removeprefix("torch.")
    cuda = ctx.device.type == "cuda"
    table = Table(
        f"Mixed precision (overdrive.amp): {w.name}, {ctx.device.type}, {half} half, batch {w.batch_size}",
        ["run", "test accuracy", "vs O0 (points)", "final train loss", "samples/s", "epochs min-max", "speed vs O0",
         "speed vs hand-written", "memory MiB", "skipped steps", "note"], stage="amp",
    )
    base: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    for level in ctx.opt_levels:
        model, trainer, result = train_digits(ctx, level)
        table.curves[level] = result.curve
        if result.diverged is not None:
            why = ": O3 has no loss scaling" if level == "O3" else ""
            rows.append({"run": level, "note": f"diverged in epoch {result.diverged}{why}"})
            continue
        last = result.history[-1]
        rows.append({"run": level, "acc": last.eval_accuracy, "loss": result.final_loss, "tput": result.samples_per_s,
                     "spread": epoch_spread([e.samples_per_s for e in result.history[1:] or result.history]),
                     "mem": result.peak_memory_mib, "skipped": sum(e.skipped_steps for e in result.history)})
        if level == "O0":
            base = {"acc": last.eval_accuracy, "tput": result.samples_per_s}
            ctx.fp32_model = copy.deepcopy(model).eval()
            ctx.fp32_accuracy = last.eval_accuracy
    hand = None
    # the hand-written baseline: on the tiny quick CNN on CPU it says nothing; with O0 alone (the fp32 model the
    # quant/sparsity/engine stages start from) there is no half-precision run to hold against it, so it and its O2
    # row are not trained (they took 213 of 250 s of a `--stage engine` run on this CPU)
    if (w.width is not None or cuda) and any(level != "O0" for level in ctx.opt_levels):
        hand = handwritten(ctx, compile=cuda)
        label = f"hand-written: autocast {half} + channels_last" + (" + torch.compile" if cuda else "")
        table.curves[label] = hand["curve"]
        rows.append({"run": label, "acc": hand["accuracy"], "loss": hand["final_loss"], "tput": hand["samples_per_s"],
                     "spread": epoch_spread(hand["epoch_rates"]),
                     "note": "plain PyTorch, no overdrive"})
        # overdrive's best against it, with the same layout (and compile on a GPU)
        _, _, best = train_digits(ctx, "O2", compile=cuda, channels_last=True)
        name = "O2 + channels_last" + (" + torch.compile" if cuda else "")
        if best.diverged is None:
            rows.append({"run": name, "acc": best.history[-1].eval_accuracy, "loss": best.final_loss,
                         "tput": best.samples_per_s, "mem": best.peak_memory_mib,
                         "spread": epoch_spread([e.samples_per_s for e in best.history[1:] or best.history]),
                         "skipped": sum(e.skipped_steps for e in best.history),
                         "note": "Trainer(channels_last=True" + (", compile=True)" if cuda else ")")})
            table.curves[name] = best.curve
    for r in rows:
        acc = r.get("acc")
        delta = 100 * (acc - base["acc"]) if acc is not None and base else None
        vs0 = r["tput"] / base["tput"] if "tput" in r and base else None
        vsh = r["tput"] / hand["samples_per_s"] if "tput" in r and hand and not r["run"].startswith("hand") else None
        table.rows.append([r["run"], acc, delta, r.get("loss"), r.get("tput"), r.get("spread"), vs0, vsh, r.get("mem"), r.get("skipped"),
                           r.get("note", "")])
        if vs0 is not None and r["run"] != "O0":
            table.add_speedup(r["run"], vs0, "O0 (fp32)", delta)
        if vsh is not None and "channels_last" in r["run"]:
            table.add_speedup(r["run"], vsh, "hand-written autocast" + (" + compile" if cuda else ""),
                              None if hand is None or acc is None else 100 * (acc - hand["accuracy"]))
    fp8_row(ctx, table)
    mem = "peak CUDA memory allocated" if cuda else "training state (params, grads, masters, optimizer state)"
    timed = ("samples/s excludes the first (warm-up, compile) epoch, 'epochs min-max' gives its slowest and fastest "
             "timed epoch" if ctx.epochs > 1 else "samples/s is the one epoch's, warm-up (and compile) included: "
             "--epochs 2 or more leaves it out")
    table.notes.append(f"memory: {mem}; {timed}; every run starts from "
                       f"the same seed and sees the same batches; {ctx.epochs} epoch(s) of {len(ctx.data.y_train)} images.")
    if not cuda:
        from overdrive._utils.device import cpu_features, cpu_summary

        f = cpu_features()
        native = f["amx_bf16"] or f["avx512_bf16"]
        table.notes.append(
            f"CPU {cpu_summary(f)}: " + ("bf16 is native here; the half rows' speed vs O0 is what it gives at this "
                                         "size. " if native else
                                         "without native bf16 torch emulates bf16 math, so half levels run slower here. ")
            + "Mixed precision pays most on tensor-core GPUs (`overdrive demo --device cuda`; "
            "benchmarks/results/amp_train_resnet50.md). The channels_last rows skip torch.compile on CPU (minutes "
            "to compile the training graph on a few cores).")
    return table


def fp8_row(ctx: DemoContext, table: Table) -> None:
    """fp8 where the GPU has it: O2 + fp8 tensorwise against O2 bf16, both compiled, on a transformer-size MLP
    block (two 4096x4096 Linear layers, 8,192 tokens, forward + backward + AdamW), since the workload's own Linear
    layers are far too small for fp8 to gain; elsewhere a note says why there is no fp8 row."""
    from overdrive import amp
    from overdrive._utils.device import supports_fp8
    from overdrive.amp import fp8 as fp8_mod

    if not supports_fp8(ctx.device) or not fp8_mod.is_available():
        where = ctx.device.type if ctx.device.type != "cuda" else torch.cuda.get_device_name(ctx.device)
        missing = [] if supports_fp8(ctx.device) else ["a CUDA GPU of compute capability 8.9+ (H100, H200, L40S)"]
        if not fp8_mod.is_available():
            missing.append("torchao (pip install -e '.[fp8]')")
        table.notes.append(f"fp8 training (amp.Fp8): no row on {where}; it needs {' and '.join(missing)}.")
        return
    n_small = sum(c.fp8 for c in fp8_mod.plan(ctx.workload.make_model(), amp.Fp8()))
    d, tokens, steps = 4096, 8192, 20
    speed: dict[str, float] = {}
    for label, fp8 in (("bf16", None), ("fp8", amp.Fp8(recipe="tensorwise"))):
        torch.manual_seed(ctx.seed)
        block = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, d)).to(ctx.device)
        opt = torch.optim.AdamW(block.parameters(), lr=1e-4, fused=True)
        mp = amp.prepare(block, opt, Policy(opt_level="O2", dtype=torch.bfloat16, fp8=fp8), autocast_hooks=False)
        fwd = torch.compile(block)
        x = torch.randn(tokens, d, device=ctx.device)

        def step() -> None:
            mp.backward(fwd(x).float().square().mean())
            mp.step()
            mp.zero_grad()

        for _ in range(3):  # compile and warm up
            step()
        torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize(ctx.device)
        speed[label] = steps * tokens / (time.perf_counter() - t0)
        del block, opt, mp, fwd
        torch._dynamo.reset()
    ratio = speed["fp8"] / speed["bf16"]
    name = "O2 + fp8 tensorwise + compile (MLP block)"
    table.rows.append([name, None, None, None, None, None, None, None, None, None,
                       f"{ratio:.2f}x O2 bf16 + compile on two {d}x{d} Linear layers, {tokens} tokens "
                       f"({speed['fp8']:,.0f} vs {speed['bf16']:,.0f} tokens/s)"])
    table.add_speedup(name, ratio, "O2 bf16 + compile (same MLP block)")
    table.notes.append(f"fp8: the workload's own model has {n_small} Linear layer(s) that amp.Fp8's shape rule puts in "
                       "fp8 (too small a GEMM gains nothing), so the fp8 row times a transformer-size MLP block; "
                       "benchmarks/amp_fp8.py measures whole models.")
