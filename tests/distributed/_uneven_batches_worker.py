"""Run under torchrun with 2 ranks (gloo): ``Trainer.fit`` where rank 0's data has 3 batches and rank 1's 2 (a
hand-sharded dataset), then the same with 2 batches on each. Each rank writes ``$OUT/rank<r>.json``: the error each
uneven fit raised (per strategy) and the step count of the even one.

Before the check, rank 1 finished its 2 steps and went on while rank 0 waited in its third step's collective: a
hang, or gloo's "Connection closed by peer" once rank 1 exited.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.train import Trainer


def data(rank: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(batches)]


def main(out: str) -> None:
    env = odist.init(device="cpu")
    result: dict[str, object] = {}
    for strategy in ("ddp", "fsdp"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        tr = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), strategy=strategy, progress=False)
        try:
            tr.fit(data(env.rank, 3 if env.rank == 0 else 2), epochs=1)
            result[strategy] = None
        except UsageError as exc:
            result[strategy] = str(exc)
        result[f"{strategy}_steps_before"] = tr.step_count
        tr.fit(data(env.rank, 2), epochs=1)  # even: trains, and the ranks are still in step
        result[f"{strategy}_steps_after"] = tr.step_count
    with open(f"{out}/rank{env.rank}.json", "w") as f:
        json.dump(result, f)
    odist.leave()


if __name__ == "__main__":
    main(sys.argv[1])
