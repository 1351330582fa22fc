"""Demo stage: the digits CNN trained in one process, then with DDP and FSDP2 on 2 ranks under torchrun
(gloo on CPU, NCCL when 2 GPUs are visible), at the same global batch; plus the doctor's findings."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from overdrive.demo.context import DemoContext
from overdrive.demo.report import Table

EPOCHS = 3  # enough for the runs to converge to comparable accuracy; keeps the stage near 20 s on 2 CPU cores
RANKS = 2


def run(ctx: DemoContext) -> Table:
    from overdrive import distributed as odist
    from overdrive.demo.distributed_worker import train
    from overdrive.distributed.doctor import diagnose
    from overdrive.distributed.launch import launch
    from overdrive.train import evaluate

    gpus = ctx.device.type == "cuda" and torch.cuda.device_count() >= RANKS
    device = "cuda" if gpus else "cpu"
    _, test = ctx.digits.loaders(batch_size=ctx.batch_size, seed=ctx.seed)
    model, loss, seconds = train(None, EPOCHS, ctx.batch_size, 3e-3, ctx.seed, 0, 1, torch.device(device, 0) if gpus else
                                 torch.device("cpu"))
    n_samples = EPOCHS * (len(ctx.digits.x_train) // ctx.batch_size) * ctx.batch_size
    rows = [{"strategy": "none (1 process)", "ranks": 1, "backend": "-", "accuracy": evaluate(model, test)[1],
             "loss": loss, "seconds": seconds}]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dist.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")  # two ranks on a laptop's cores: no oversubscription
        rc = launch(odist.LaunchConfig(nproc_per_node=RANKS), "overdrive.demo.distributed_worker",
                    [str(out), "--epochs", str(EPOCHS), "--batch-size", str(ctx.batch_size), "--seed", str(ctx.seed),
                     "--device", device], module=True, env=env, timeout_s=900)  # a hung rank cannot stall the demo
        if rc != 0 or not out.exists():
            raise RuntimeError(f"the {RANKS}-rank run failed (torchrun exit code {rc}); run `overdrive doctor` to check "
                               "the set-up")
        rows += json.loads(out.read_text())
        states = {"none (1 process)": model.state_dict()}
        for r in rows[1:]:
            states[r["strategy"]] = torch.load(f"{out}.{r['strategy']}.pt", weights_only=True)
    ddp = states.get("ddp")
    backend = rows[-1]["backend"]
    table = Table(f"Distributed training (overdrive.distributed) on digits, {RANKS} ranks on {device} ({backend})",
                  ["strategy", "ranks", "test accuracy", "vs 1 process (points)", "final loss", "samples/s",
                   "max |w - w_ddp|"])
    base = rows[0]["accuracy"]
    for r in rows:
        w = states[r["strategy"]]
        diff = max(float((w[k].float() - ddp[k].float()).abs().max()) for k in ddp if ddp[k].is_floating_point()) \
            if ddp is not None else None
        table.rows.append([r["strategy"], r["ranks"], r["accuracy"], 100 * (r["accuracy"] - base),
                           r["loss"], n_samples / r["seconds"], None if diff is None else f"{diff:.1e}"])
    report = diagnose(topology=False)
    flagged = [f for f in report["findings"] if f["level"] in ("warning", "error")]
    table.notes.append(f"global batch {ctx.batch_size} ({ctx.batch_size // RANKS} per rank), {EPOCHS} epochs, AdamW, the "
                       "same shuffled batches in every run; BatchNorm normalizes over each rank's 32 samples, so one "
                       "process (over 64) follows another trajectory to a similar accuracy (the tests check that DDP and "
                       "FSDP2 equal one process to 1e-5 on a BN-free model)")
    table.notes.append("FSDP2 shards each block's weights and gathers them for every forward and backward: the same "
                       "weights as DDP (last column), slower on a model this small; it pays when a model does not fit "
                       "on one GPU")
    if not gpus:
        table.notes.append(f"{RANKS} CPU ranks share this machine's cores: samples/s shows the communication cost, "
                           "not a speed-up; on GPUs use `overdrive launch --nproc-per-node N train.py`")
    table.notes.append(f"overdrive doctor: torch {report['versions'].get('torch')}, {len(report['gpus'])} GPU(s), "
                       f"{len(report['env'])} NCCL variable(s) set, {len(flagged)} warning(s)/error(s)"
                       + (": " + "; ".join(f"{f['what']}: {f['detail']}" for f in flagged) if flagged else ""))
    return table
