"""Run under torchrun with 2 ranks (gloo): one step where rank 0's batch holds no samples (what
overdrive.data yields when every file of a batch was undecodable) and rank 1's holds 4.

Rank 0's mean loss over no samples is NaN; it once made rank 0 skip the step while rank 1 applied the
all-reduced gradient, so the DDP replicas drifted apart. Each rank writes ``$OUT/rank<r>.pt``: its parameters
after the step, its skipped-step count and its reported loss, for DDP and for FSDP2.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from overdrive import distributed as odist
from overdrive.train import Trainer


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    return (x[:0], y[:0]) if rank == 0 else (x, y)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def main(out: str) -> None:
    env = odist.init(device="cpu")
    results = {}
    for strategy in ("ddp", "fsdp"):
        m = model()
        tr = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9), progress=False, strategy=strategy)
        loss = tr.train_step(batch(env.rank))
        params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                  for k, v in tr.model.state_dict().items()}
        results[strategy] = {"params": params, "skipped": tr.skipped_steps, "loss": float(loss)}
    torch.save(results, f"{out}/rank{env.rank}.pt")
    odist.leave()


if __name__ == "__main__":
    main(sys.argv[1])
