"""Evaluation over torch's ``DistributedSampler`` (2 gloo ranks on CPU): with 9 samples the sampler pads rank 1's
shard with a repeat of the first sample of the order, so each rank sees 5. ``evaluate(over_ranks=True)`` and
``fit``'s ``eval_loss`` / ``eval_accuracy`` leave that repeat out and equal one process evaluating the 9 samples
(float64 reference, within 1e-6), with and without shuffling, batch sizes 2 (padding alone in the last batch) and 4,
and with a user ``loss_fn``. Counting the repeat had averaged over 10 samples, one of them twice.
This file is also the 2-rank worker (run by the package's launcher, with a timeout so a hang fails)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HERE = Path(__file__).parent
N = 9


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _reference() -> tuple[float, float]:
    """Mean cross-entropy and top-1 accuracy over the 9 samples, in float64, in one process."""
    x, y = _dataset().tensors
    with torch.no_grad():
        out = _model().double()(x.double())
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(-1) == y).double().mean())


def _worker(out: str) -> None:
    from overdrive import distributed as odist
    from overdrive.train import Trainer, evaluate

    env = odist.init(device="cpu")
    ds = _dataset()
    result: dict[str, object] = {}
    for shuffle in (False, True):
        for bs in (2, 4):
            sampler = DistributedSampler(ds, env.world_size, env.rank, shuffle=shuffle, seed=1)
            loader = DataLoader(ds, batch_size=bs, sampler=sampler)
            result[f"evaluate-{shuffle}-{bs}"] = evaluate(_model(), loader, over_ranks=True)
            result[f"loss_fn-{shuffle}-{bs}"] = evaluate(_model(), loader, over_ranks=True,
                                                         loss_fn=nn.functional.cross_entropy)
    model = _model()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), strategy="ddp", progress=False)
    loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, env.world_size, env.rank, shuffle=True))
    stats = t.fit([ds[0:2], ds[2:4]], epochs=1, eval_data=loader).history[-1]
    result["fit"] = (stats.eval_loss, stats.eval_accuracy)
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(result))
    odist.leave()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from overdrive.distributed import LaunchConfig
    from overdrive.distributed.launch import launch

    sys.path.insert(0, str(HERE))
    from _rank_env import worker_env

    out = tmp_path_factory.mktemp("eval_padding")
    rc = launch(LaunchConfig(nproc_per_node=2), str(Path(__file__)), [str(out)], env=worker_env(), timeout_s=240)
    assert rc == 0, f"torchrun exit code {rc} (a hang ends in the timeout)"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_padded_repeats_are_not_counted(ranks: list[dict]) -> None:
    ref_loss, ref_acc = _reference()
    for r, res in enumerate(ranks):
        for case, (loss, acc) in res.items():
            assert loss == pytest.approx(ref_loss, rel=0, abs=1e-6), (r, case, loss, ref_loss)
            assert acc == pytest.approx(ref_acc, rel=0, abs=1e-12), (r, case, acc, ref_acc)


def test_unpadded_samples_per_rank() -> None:
    from overdrive.train.evaluation import _unpadded_samples

    ds = list(range(10))
    for n, world, want in ((9, 2, [5, 4]), (10, 2, [None, None]), (10, 4, [3, 3, 2, 2]), (1, 2, [1, 0])):
        loaders = [DataLoader(ds[:n], batch_size=3, sampler=DistributedSampler(ds[:n], world, r)) for r in range(world)]
        assert [_unpadded_samples(dl) for dl in loaders] == want, (n, world)
    dropped = DataLoader(ds[:9], sampler=DistributedSampler(ds[:9], 2, 1, drop_last=True))
    assert _unpadded_samples(dropped) is None  # drop_last trims instead of padding
    assert _unpadded_samples([(torch.zeros(2, 1), torch.zeros(2))]) is None


if __name__ == "__main__":
    _worker(sys.argv[1])
