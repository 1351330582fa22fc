"""``Trainer(strategy="ddp", accumulate=2)`` on a model with BatchNorm: every rank's parameters *and* running stats
equal a hand-written DDP loop's (``no_sync`` on the first micro-batch, a synced second one), exactly.

Every micro-batch of the Trainer runs in ``no_sync``; DDP took that to mean "no buffer broadcast at the next
forward", so rank 1's running mean and variance drifted from rank 0's (0.11 and 0.65 off after 3 steps) where
plain DDP broadcasts rank 0's at each step's first forward. This file is also the 2-rank worker (run by torchrun).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).parent


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, of its own scale
    return [(torch.randn(4, 8, generator=g) * (1 + rank), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _worker(out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from overdrive import distributed as odist
    from overdrive.train import Trainer

    env = odist.init(device="cpu")
    batches = _batches(env.rank, 6)  # 3 optimizer steps of 2 micro-batches
    ref = _model()
    ddp = DistributedDataParallel(ref)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        if i % 2 == 0:
            with ddp.no_sync():
                (nn.functional.cross_entropy(ddp(x), y) / 2).backward()
        else:
            (nn.functional.cross_entropy(ddp(x), y) / 2).backward()
            opt.step()
            opt.zero_grad()
    model = _model()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy="ddp", accumulate=2,
                progress=False)
    for b in batches:
        t.train_step(b)
    got, want = model.state_dict(), ref.state_dict()
    diff = {k: float((got[k].double() - want[k].double()).abs().max()) for k in want}
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(diff))
    odist.leave()


def test_ddp_accumulation_broadcasts_buffers_as_plain_ddp(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from _rank_env import worker_env

    from overdrive.distributed import LaunchConfig
    from overdrive.distributed.launch import launch

    rc = launch(LaunchConfig(nproc_per_node=2), str(Path(__file__)), [str(tmp_path)], env=worker_env(), timeout_s=240)
    assert rc == 0, f"torchrun exit code {rc}"
    for r in range(2):
        diff = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(diff) >= {"1.running_mean", "1.running_var", "0.weight"}
        assert all(v == 0.0 for v in diff.values()), (r, diff)  # the same ops in the same order: bit for bit


if __name__ == "__main__":
    _worker(sys.argv[1])
