"""Demo stage: the digits CNN trained in one process, then with DDP and FSDP2 under torchrun, at the same
global batch: one rank per GPU over NCCL where 2+ GPUs are visible, else 2 CPU ranks over gloo (beside a
1-GPU single-process run where there is one GPU); plus the doctor's findings.

On CPU every run gets the same cores: the single process ``cores`` threads, each of the R gloo ranks
``cores // R`` (``OMP_NUM_THREADS``), so samples/s compares the strategies, not thread counts. samples/s is
the median over epochs, with the slowest and fastest epoch beside it."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from overdrive.demo.context import DemoContext
from overdrive._utils.table import Table

EPOCHS = 3  # enough for the runs to converge to comparable accuracy; keeps the stage near 20 s on 2 CPU cores
BATCH = 64  # the digits CNN's global batch, whatever the workload of the other stages


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at ``n`` for the block, then as they were (the demo changes no process setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rank_threads(cores: int, ranks: int) -> int:
    """Threads per CPU rank: the cores shared out evenly, at least one each.

    Example:
        >>> rank_threads(8, 2), rank_threads(2, 2), rank_threads(1, 2)
        (4, 1, 1)
    """
    return max(1, cores // ranks)


def _rate(samples_per_epoch: int, epoch_s: list[float]) -> tuple[float, str]:
    """(median samples/s over epochs, "slowest-fastest" epoch samples/s).

    Example:
        >>> _rate(100, [1.0, 0.5, 0.25])
        (200.0, '100-400')
    """
    rates = [samples_per_epoch / s for s in epoch_s]
    return statistics.median(rates), f"{min(rates):,.0f}-{max(rates):,.0f}"


def run(ctx: DemoContext) -> Table:
    from overdrive import distributed as odist
    from overdrive._utils.progress import status
    from overdrive.data.config import usable_cpus
    from overdrive.demo.distributed_worker import train
    from overdrive.distributed.doctor import diagnose
    from overdrive.distributed.launch import launch
    from overdrive.train import evaluate

    n_gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    gpus = n_gpus >= 2
    ranks = min(n_gpus, 8) if gpus else 2  # one rank per GPU (BATCH splits evenly over up to 8)
    device = "cuda" if gpus else "cpu"
    batch = BATCH
    cores = usable_cpus()
    per_rank = rank_threads(cores, ranks)
    _, test = ctx.digits.loaders(batch_size=batch, seed=ctx.seed)
    with status(f"distributed: 1 process ({EPOCHS} epochs)", enabled=ctx.progress), _threads(per_rank * ranks):
        model, loss, seconds, epoch_s = train(None, EPOCHS, batch, 3e-3, ctx.seed, 0, 1,
                                              torch.device(device, 0) if gpus else torch.device("cpu"))
    per_epoch = (len(ctx.digits.x_train) // batch) * batch
    rows = [{"strategy": "none (1 process)", "ranks": 1, "backend": "-", "accuracy": evaluate(model, test)[1],
             "loss": loss, "seconds": seconds, "epoch_seconds": epoch_s, "threads": per_rank * ranks}]
    extra = None
    if n_gpus == 1:  # the one GPU: the single-process run there, beside the CPU ranks
        gmodel, gloss, gseconds, gepoch_s = train(None, EPOCHS, batch, 3e-3, ctx.seed, 0, 1, torch.device("cuda", 0))
        extra = {"strategy": "none (1 process, 1 GPU)", "ranks": 1, "backend": "-",
                 "accuracy": evaluate(gmodel.cpu(), test)[1], "loss": gloss, "seconds": gseconds,
                 "epoch_seconds": gepoch_s, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dist.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(per_rank))  # the cores shared out: no oversubscription
        if not gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: they must not each take the one GPU
        with status(f"distributed: DDP then FSDP2 on {ranks} {device} ranks under torchrun ({EPOCHS} epochs each)",
                    enabled=ctx.progress):
            rc = launch(odist.LaunchConfig(nproc_per_node=ranks), "overdrive.demo.distributed_worker",
                        [str(out), "--epochs", str(EPOCHS), "--batch-size", str(batch), "--seed", str(ctx.seed),
                         "--device", device], module=True, env=env, timeout_s=900)  # a hung rank cannot stall it
        if rc != 0 or not out.exists():
            raise RuntimeError(f"the {ranks}-rank run failed (torchrun exit code {rc}); run `overdrive doctor` to check "
                               "the set-up")
        rows += json.loads(out.read_text())
        states = {"none (1 process)": model.state_dict()}
        for r in rows[1:]:
            states[r["strategy"]] = torch.load(f"{out}.{r['strategy']}.pt", weights_only=True)
    if extra is not None:
        rows.insert(1, extra)
        states[extra["strategy"]] = gmodel.state_dict()
    ddp = states.get("ddp")
    backend = rows[-1]["backend"]
    table = Table(f"Distributed training (overdrive.distributed) on digits, {ranks} ranks on {device} ({backend})",
                  ["strategy", "ranks", "threads/rank", "test accuracy", "vs 1 process (points)", "final loss",
                   "samples/s", "epochs min-max", "max |w - w_ddp|"], stage="distributed")
    base = rows[0]["accuracy"]
    for r in rows:
        w = states[r["strategy"]]
        diff = max(float((w[k].float() - ddp[k].float()).abs().max()) for k in ddp if ddp[k].is_floating_point()) \
            if ddp is not None else None
        rate, spread = _rate(per_epoch, r["epoch_seconds"])
        table.rows.append([r["strategy"], r["ranks"], r.get("threads", "-"), r["accuracy"],
                           100 * (r["accuracy"] - base), r["loss"], rate, spread,
                           None if diff is None else f"{diff:.1e}"])
    report = diagnose(topology=False)
    flagged = [f for f in report["findings"] if f["level"] in ("warning", "error")]
    for r in table.rows[1:]:
        if r[0] in ("ddp", "fsdp"):
            table.add_speedup(f"{r[0]} x{ranks}", r[6] / table.rows[0][6], "1 process", r[4])
    table.notes.append(f"global batch {batch} ({batch // ranks} per rank), {EPOCHS} epochs, AdamW, the "
                       f"same shuffled batches in every run; BatchNorm normalizes over each rank's {batch // ranks} samples, so one "
                       f"process (over {batch}) follows another trajectory to a similar accuracy (the tests check that DDP and "
                       "FSDP2 equal one process to 1e-5 on a BN-free model)")
    table.notes.append("FSDP2 shards each block's weights and gathers them for every forward and backward: the same "
                       "weights as DDP (last column), slower on a model this small; it pays when a model does not fit "
                       "on one GPU")
    if n_gpus == 1:
        table.notes.append("one GPU here: DDP/FSDP2 run on 2 CPU ranks (gloo) beside the 1-GPU single-process row; "
                           "with N GPUs the stage runs N ranks over NCCL (`overdrive launch --nproc-per-node N`)")
    if not gpus:
        ratios = ", ".join(f"{r[0]} {r[6] / table.rows[0][6]:.2f}x" for r in table.rows[1:] if r[0] in ("ddp", "fsdp"))
        table.notes.append(
            f"{ranks} CPU ranks share this machine's {cores} core(s): {per_rank} thread(s) per rank "
            f"(OMP_NUM_THREADS), {per_rank * ranks} in the single process, so every run has the same cores; measured "
            f"samples/s against 1 process: {ratios}. Each rank runs 1/{ranks} of every batch and then all-reduces the "
            "gradients, so on one machine's cores the difference is how well the smaller per-rank work uses a "
            "thread against the communication cost, not more hardware; on GPUs use "
            "`overdrive launch --nproc-per-node N train.py`")
    table.notes.append(f"samples/s: median over the {EPOCHS} epochs of each run (the first includes warm-up); "
                       "epochs min-max: its slowest and fastest epoch")
    table.notes.append(f"overdrive doctor: torch {report['versions'].get('torch')}, {len(report['gpus'])} GPU(s), "
                       f"{len(report['env'])} NCCL variable(s) set, {len(flagged)} warning(s)/error(s)"
                       + (": " + "; ".join(f"{f['what']}: {f['detail']}" for f in flagged) if flagged else ""))
    return table
