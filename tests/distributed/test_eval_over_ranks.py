"""Evaluation under ``strategy="ddp"|"fsdp"`` (2 gloo ranks on CPU): each rank evaluates its own shard, of 9 and 7
samples (a short last batch on each), and ``fit``'s ``eval_loss`` / ``eval_accuracy`` equal one process evaluating
all 16 samples (float64 reference, within 1e-6), on every rank. The mean of the two ranks' means weighted the
7-sample shard like the 9-sample one. Under DDP the shards may differ in batch count (3 and 2 batches); under FSDP2,
whose forwards all-gather, a different count raises the same UsageError on both ranks instead of hanging. A rank
with no evaluation sample at all still joins the sum.
This file is also the 2-rank worker (run by the package's launcher, with a timeout so a hang fails)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).parent
# per rank: the eval batches' sizes, 9 and 7 samples; "ddp" also with 3 and 2 batches
SIZES = {"same_count": {0: [4, 4, 1], 1: [4, 2, 1]}, "other_count": {0: [4, 4, 1], 1: [4, 3]}}


def _shard(rank: int, layout: str = "same_count") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(b, 5, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in SIZES[layout][rank]]


def _train(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(20 + rank)
    return [(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]


def _reference(model: nn.Module, layout: str) -> tuple[float, float]:
    """Mean cross-entropy and top-1 accuracy over both shards' samples, in float64, in one process."""
    x = torch.cat([b[0] for r in (0, 1) for b in _shard(r, layout)]).double()
    y = torch.cat([b[1] for r in (0, 1) for b in _shard(r, layout)])
    with torch.no_grad():
        out = model.double()(x)
    model.float()
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(-1) == y).double().mean())


def _worker(out: str) -> None:
    import copy

    from overdrive import distributed as odist
    from overdrive._utils.errors import UsageError
    from overdrive.train import Trainer, evaluate

    env = odist.init(device="cpu")
    result: dict[str, object] = {}
    for strategy, layout in (("ddp", "same_count"), ("ddp", "other_count"), ("fsdp", "same_count"),
                             ("fsdp", "other_count")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        plain = copy.deepcopy(model)
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), strategy=strategy, progress=False)
        try:
            stats = t.fit(_train(env.rank), epochs=1, eval_data=_shard(env.rank, layout)).history[-1]
        except UsageError as exc:
            result[f"{strategy}-{layout}"] = {"error": str(exc)}
            continue
        ref_loss, ref_acc = _reference(plain, layout)  # lr 0: the trained model is the initial one
        result[f"{strategy}-{layout}"] = {"eval_loss": stats.eval_loss, "eval_accuracy": stats.eval_accuracy,
                                          "ref_loss": ref_loss, "ref_acc": ref_acc}
    # the function itself: rank 1 holds no sample
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    only0 = _shard(0) if env.rank == 0 else []
    loss, acc = evaluate(model, only0, over_ranks=True)
    alone, alone_acc = evaluate(model, _shard(0))
    result["empty_rank"] = {"loss": loss, "acc": acc, "ref_loss": alone, "ref_acc": alone_acc}
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(result))
    odist.leave()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from overdrive.distributed import LaunchConfig
    from overdrive.distributed.launch import launch

    sys.path.insert(0, str(HERE))
    from _rank_env import worker_env

    out = tmp_path_factory.mktemp("eval_ranks")
    rc = launch(LaunchConfig(nproc_per_node=2), str(Path(__file__)), [str(out)], env=worker_env(), timeout_s=240)
    assert rc == 0, f"torchrun exit code {rc} (a hang ends in the timeout)"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", ["ddp-same_count", "ddp-other_count", "fsdp-same_count"])
def test_fit_eval_is_the_mean_over_every_ranks_samples(ranks: list[dict], case: str) -> None:
    for r, res in enumerate(ranks):
        got = res[case]
        assert "error" not in got, (r, got)
        assert got["eval_loss"] == pytest.approx(got["ref_loss"], rel=0, abs=1e-6), (r, got)
        assert got["eval_accuracy"] == pytest.approx(got["ref_acc"], rel=0, abs=1e-12), (r, got)
    assert ranks[0][case]["eval_loss"] == ranks[1][case]["eval_loss"]  # one value, the same decisions


def test_fsdp_eval_with_another_batch_count_per_rank_is_refused_on_every_rank(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks):
        msg = res["fsdp-other_count"].get("error", "")
        assert f"this rank ({r}) has {3 - r} evaluation batches" in msg and "between 2 and 3" in msg, (r, msg)


def test_evaluate_over_ranks_with_an_empty_rank(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks):
        got = res["empty_rank"]
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=0, abs=1e-12), (r, got)
        assert got["acc"] == pytest.approx(got["ref_acc"], rel=0, abs=1e-12), (r, got)


if __name__ == "__main__":
    _worker(sys.argv[1])
