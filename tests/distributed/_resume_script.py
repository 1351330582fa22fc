"""A resumable training script for `overdrive launch` (tests and the GPU check).

Trains an MLP on fixed synthetic data with a ResumableSampler, saves a DCP checkpoint every
``--save-every`` steps, resumes from the newest one at start, and (``--crash-at S``) kills rank 1
with os._exit at step S on the first attempt (TORCHELASTIC_RESTART_COUNT == 0). Rank 0 writes
the final loss over the whole data set and the parameters' checksum to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

from overdrive import distributed as odist
from overdrive.amp import Fp8, Policy
from overdrive.amp import fp8 as fp8_mod
from overdrive.train import Trainer, evaluate


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--opt-level", default="O0")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fp8", default=None, help="tensorwise | rowwise: every Linear with 16-multiple dims in fp8")
    a = ap.parse_args(argv)

    env = odist.init(device=a.device)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    n = 512
    x, y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
    model = nn.Sequential(nn.Linear(16, a.width), nn.ReLU(), nn.Linear(a.width, a.width), nn.ReLU(), nn.Linear(a.width, 4)).to(env.device)
    fp8 = None if a.fp8 is None else Fp8(recipe=a.fp8, min_features=0, min_weight=0)
    policy = Policy(opt_level=a.opt_level, dtype=a.dtype, fp8=fp8) if a.opt_level != "O0" else "O0"
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy=policy, progress=False,
                      strategy=a.strategy, device=env.device)
    sampler = odist.ResumableSampler(n, a.batch, env.rank, env.world_size, shuffle=True, seed=0)
    last = odist.checkpoint.latest(a.ckpt)
    if last is not None:
        sampler.load_state_dict(odist.checkpoint.load(last, trainer))
    losses = []
    while trainer.step_count < a.steps:
        sampler.set_epoch(trainer.epoch)
        order = list(sampler)
        for start in range(0, len(order), a.batch):
            if trainer.step_count >= a.steps:
                break
            if trainer.step_count == a.crash_at and env.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os._exit(17)  # a crash, not an exception: no cleanup, the group is left hanging
            idx = torch.tensor(order[start:start + a.batch])
            losses.append(float(trainer.train_step((x[idx], y[idx]))))
            sampler.advance()
            if trainer.step_count % a.save_every == 0:
                odist.checkpoint.save(a.ckpt, trainer, position=sampler.state_dict())
        else:
            trainer.epoch += 1
            continue
    full_loss, _ = evaluate(trainer.model, [(x, y)])  # the whole data set: the same on any rank count
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float() for k, v in trainer.model.state_dict().items()}
    if env.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"final_loss": full_loss, "last_batch_loss": losses[-1] if losses else None, "steps": trainer.step_count, "world_size": env.world_size,
                       "fp8_layers": len(fp8_mod.fp8_modules(trainer.model)),
                       "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       "param_sum": float(sum(v.double().sum() for v in full.values()))}, f)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # a torchrun rank: its results are written
        # gloo's shutdown can hang the last rank for good after its peer exits (seen under a loaded suite: the
        # job then ran into launch's timeout); both ranks meet here, then leave without the shutdown
        torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
