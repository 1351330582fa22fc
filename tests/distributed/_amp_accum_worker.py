"""Run under torchrun with 2 ranks (gloo): apex-style gradient accumulation under DDP, two micro-batches per step,
the first under ``no_sync()`` with ``amp.scale_loss(..., delay_unscale=True)`` (apex's documented pattern), for opt
levels O0, O1 and O2 (bf16 on CPU), with torch's DDP and with apex's DistributedDataParallel
(``disable_allreduce()`` / ``enable_allreduce()``).

Kept aside during the second backward, the first micro-batch's gradients were never all-reduced: the replicas
differed by 0.09 after one step. Each rank writes ``$OUT/rank<r>.pt``: its weights after the step, per case.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from overdrive import distributed as odist


def batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def main(out: str) -> None:
    env = odist.init(device="cpu")
    from overdrive.apex import amp
    from overdrive.apex.parallel import DistributedDataParallel as ApexDDP

    results = {}
    for level in ("O0", "O1", "O2"):
        for wrapper in ("torch", "apex"):
            m = model()
            o = torch.optim.SGD(m.parameters(), lr=0.5)
            m, o = amp.initialize(m, o, opt_level=level, verbosity=0)
            d = nn.parallel.DistributedDataParallel(m) if wrapper == "torch" else ApexDDP(m)
            for i in range(2):
                x, y = batch(env.rank, i)
                if wrapper == "torch":
                    ctx = d.no_sync() if i == 0 else contextlib.nullcontext()
                else:
                    (d.disable_allreduce if i == 0 else d.enable_allreduce)()
                    ctx = contextlib.nullcontext()
                with ctx:
                    loss = nn.functional.cross_entropy(d(x).float(), y) / 2
                    with amp.scale_loss(loss, o, delay_unscale=i == 0) as scaled:
                        scaled.backward()
            o.step()
            results[f"{level}-{wrapper}"] = {k: v.detach().float().clone() for k, v in m.state_dict().items()}
    torch.save(results, f"{out}/rank{env.rank}.pt")
    odist.leave()


if __name__ == "__main__":
    main(sys.argv[1])
