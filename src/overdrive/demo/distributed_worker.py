"""The demo's distributed run, one process per rank under torchrun (``overdrive.distributed.launch``):
the digits CNN trained with each strategy on the same global batches the single-process run sees, each
rank taking its contiguous slice of every batch. Rank 0 writes accuracy, loss and timing as JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m overdrive.demo.distributed_worker OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from overdrive._utils.files import atomic_torch_save, atomic_write


def global_batches(n: int, batch: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """Index batches of one epoch, shuffled from (seed, epoch); the same on every rank and in one process."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return [perm[i:i + batch] for i in range(0, n - batch + 1, batch)]


def train(strategy: str | None, epochs: int, batch: int, lr: float, seed: int, rank: int, world: int,
          device: torch.device) -> tuple[torch.nn.Module, float, float, list[float]]:
    """Train a fresh DigitsCNN; returns (a full, unwrapped copy of the model, mean loss of the last epoch,
    training seconds, the seconds of each epoch)."""
    from overdrive.recipes.data import load_digits
    from overdrive.recipes.models import DigitsCNN
    from overdrive.train import Trainer

    digits = load_digits(seed=seed)
    torch.manual_seed(seed)
    model = DigitsCNN().to(device)
    steps = epochs * (len(digits.x_train) // batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)  # as the amp stage trains
    trainer = Trainer(model, opt, device=device, progress=False, strategy=strategy, scheduler=sched)
    per_rank = batch // world
    t0 = time.perf_counter()
    losses: list[torch.Tensor] = []
    epoch_s: list[float] = []
    for epoch in range(epochs):
        losses = []
        e0 = time.perf_counter()
        for idx in global_batches(len(digits.x_train), batch, epoch, seed):
            mine = idx[rank * per_rank:(rank + 1) * per_rank]
            losses.append(trainer.train_step((digits.x_train[mine], digits.y_train[mine])))
        epoch_s.append(time.perf_counter() - e0)
    last = torch.stack(losses).mean()
    if world > 1:  # the mean over ranks of each rank's mean loss
        dist.all_reduce(last)
        last /= world
    seconds = time.perf_counter() - t0
    full = DigitsCNN()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()  # FSDP2 shards: a collective
             for k, v in trainer.model.state_dict().items()}
    full.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    return full.eval(), float(last), seconds, epoch_s


def main() -> None:
    from overdrive import distributed as odist
    from overdrive.recipes.data import load_digits
    from overdrive.train import evaluate

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    env = odist.init(device=args.device)
    rows = []
    _, test = load_digits(seed=args.seed).loaders(batch_size=args.batch_size, seed=args.seed)
    for strategy in args.strategies.split(","):
        model, loss, seconds, epoch_s = train(strategy, args.epochs, args.batch_size, args.lr, args.seed, env.rank,
                                     env.world_size, env.device)
        acc = evaluate(model, test)[1]
        rows.append({"strategy": strategy, "ranks": env.world_size, "backend": dist.get_backend(), "accuracy": acc,
                     "loss": loss, "seconds": seconds, "epoch_seconds": epoch_s,
                     "threads": torch.get_num_threads()})
        if env.rank == 0:  # the weights, for the caller to compare runs (loaded with weights_only)
            atomic_torch_save(model.state_dict(), f"{args.out}.{strategy}.pt")
    if env.rank == 0:
        atomic_write(args.out, json.dumps(rows))
    odist.leave()  # not destroy_process_group: gloo's teardown can abort or hang a finished rank


if __name__ == "__main__":
    main()
