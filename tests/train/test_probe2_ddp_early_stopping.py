"""Early stopping under ``strategy="ddp"`` (2 gloo ranks on CPU): the decision is made on the loss averaged over
ranks, so both ranks stop at the same epoch, and a stop asked by one rank's ``on_epoch_end`` stops both. Decided on
each rank's own loss, rank 0 stopped after epoch 1 while rank 1 went on into epoch 2's all-reduce and the job hung.
This file is also the 2-rank worker (run by the package's launcher, with a timeout so a hang fails)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

SRC = Path(__file__).resolve().parents[2] / "src"
# per rank, per epoch: each rank's own loss. Rank 0 alone stops after epoch 1 (4 > 3), rank 1 alone after epoch 2;
# their mean (3, 2.5, 2.5, 5) stops after epoch 2, on both
VALUES = {0: [3.0, 4.0, 1.0, 5.0], 1: [3.0, 1.0, 4.0, 5.0]}


class _EpochValues:
    def __init__(self, values: list[float]) -> None:
        self.values, self.epoch = values, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 2

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([(torch.ones(2, 3), torch.full((2,), self.values[self.epoch])) for _ in range(2)])


def _target_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.sum() * 0.0 + y.float().mean()  # the data's value, with a (zero) gradient through every parameter


def _worker(out: str) -> None:
    from overdrive import distributed as odist
    from overdrive.train import EarlyStopping, Trainer

    env = odist.init(device="cpu")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_target_loss, strategy="ddp",
                progress=False)
    es = EarlyStopping(monitor="loss", patience=1)
    r1 = t.fit(_EpochValues(VALUES[env.rank]), max_epochs=4, early_stopping=es)
    # a stop only rank 0 asks for, after the first epoch of a second fit
    r2 = t.fit(_EpochValues([1.0] * 10), epochs=3, on_epoch_end=lambda s: env.rank == 0)
    Path(out, f"rank{env.rank}.json").write_text(json.dumps({
        "stopped": r1.stopped_epoch, "epochs": len(r1.history), "best": es.best, "own": r1.history[-1].loss,
        "stopped2": r2.stopped_epoch, "epochs2": len(r2.history),
    }))
    odist.leave()


def test_ddp_early_stopping_stops_every_rank_at_the_same_epoch(tmp_path: Path) -> None:
    from overdrive.distributed import LaunchConfig
    from overdrive.distributed.launch import launch

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    rc = launch(LaunchConfig(nproc_per_node=2), str(Path(__file__)), [str(tmp_path)], env=env, timeout_s=180)
    assert rc == 0, f"torchrun exit code {rc} (a hang ends in the timeout)"
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, g in enumerate(got):
        assert g["stopped"] == 2 and g["epochs"] == 3, (r, g)
        assert g["best"] == 2.5, (r, g)  # the mean of the ranks' losses at epoch 1
        assert g["own"] == VALUES[r][2], (r, g)  # EpochStats.loss stays each rank's own
        assert g["stopped2"] == 3 and g["epochs2"] == 1, (r, g)  # epochs count on from the first fit


if __name__ == "__main__":
    _worker(sys.argv[1])
