"""Run under torchrun with 2 ranks (gloo): four places where ranks must agree, each once silently wrong.

1. FSDP2, a step whose only inf gradient lies in rank 0's shard: every rank skips it (rank 0 skipped, rank 1 stepped,
   and the model came out half updated).
2. ReduceLROnPlateau under DDP with each rank's own loss: every rank gets the same lr (each stepped on its own loss).
3. checkpoint.save with a different position per rank: refused on every rank (one rank's was stored, silently).
4. DDP with accumulate=2 where each rank uses a different head (find_unused_parameters): the step equals the
   one-process reference (the all-reduce paired one rank's head gradients with the other's).
Each rank writes ``$OUT/rank<r>.pt`` with what it saw.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.train import Trainer


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the data picks the head: rank 0 a, rank 1 b
        return self.a(x) if bool(x[0, 0] > 0) else self.b(x)


def heads_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g).abs(), torch.randint(0, 3, (8,), generator=g)
    return (x if rank == 0 else -x), y


def inf_in_row0_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # finite, but d sqrt(u)/du at u = 0 is inf: only output column 0 (weight row 0, bias[0]: rank 0's shard) gets it
    return ((out[:, 1:] - y) ** 2).mean() + torch.sqrt(out[:, 0].clamp(min=0) * 0.0).sum()


def main(out: str) -> None:
    env = odist.init(device="cpu")
    res: dict = {}
    # 1. FSDP2 skip agreement
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4))
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), strategy="fsdp", loss_fn=inf_in_row0_loss,
                progress=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.train_step((x[env.rank::2], y[env.rank::2]))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    after = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True))
    res["fsdp"] = {"skipped": t.skipped_steps, "unchanged": all(torch.equal(after[k], before[k]) for k in before)}
    # 2. ReduceLROnPlateau: rank 0's labels are learnable, rank 1's random (its loss plateaus at once)
    torch.manual_seed(0)
    m = nn.Linear(8, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1)
    t = Trainer(m, opt, strategy="ddp", scheduler=sched, progress=False)
    g = torch.Generator().manual_seed(100 + env.rank)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long() if env.rank == 0 else torch.randint(0, 3, (64,), generator=g)
    t.fit([(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)], epochs=5)
    lrs: list = [None, None]
    dist.all_gather_object(lrs, opt.param_groups[0]["lr"])
    res["plateau_lrs"] = lrs
    # 3. checkpoint positions
    try:
        odist.checkpoint.save(f"{out}/ckpt", t, position={"batch": 10 + env.rank})
        res["position"] = "saved"
    except UsageError as exc:
        res["position"] = str(exc)
    # 4. accumulation with unused parameters
    torch.manual_seed(0)
    m = Heads()
    t = Trainer(m, torch.optim.SGD(m.parameters(), lr=1.0), strategy=odist.Strategy(kind="ddp", find_unused_parameters=True),
                accumulate=2, progress=False)
    x, y = heads_data(env.rank)
    for i in range(2):
        t.train_step((x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]))
    res["heads"] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    torch.save(res, f"{out}/rank{env.rank}.pt")
    odist.leave()


if __name__ == "__main__":
    main(sys.argv[1])
