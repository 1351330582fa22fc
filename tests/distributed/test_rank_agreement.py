"""Ranks that must agree, on gloo with 2 ranks (``_rank_agreement_worker.py``): FSDP2's skip of an inf/NaN step
whose inf lies in one rank's shard, ReduceLROnPlateau's lr under DDP, checkpoint positions, and DDP accumulation
with parameters some rank did not use (reference: one process over both ranks' data, SGD lr 1, tolerance 1e-6).
Each was silently wrong before its fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import launch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _rank_agreement_worker import Heads, heads_data  # noqa: E402
from _rank_env import worker_env  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("agree")
    rc = launch(LaunchConfig(nproc_per_node=2), str(HERE / "_rank_agreement_worker.py"), [str(out)],
                env=worker_env(), timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_fsdp_ranks_skip_a_step_together(ranks: list[dict]) -> None:
    assert [r["fsdp"]["skipped"] for r in ranks] == [1, 1]
    assert all(r["fsdp"]["unchanged"] for r in ranks)  # no half-updated model


def test_plateau_lr_is_the_same_on_every_rank(ranks: list[dict]) -> None:
    lrs = ranks[0]["plateau_lrs"]
    assert lrs[0] == lrs[1], lrs


def test_different_positions_are_refused_on_every_rank(ranks: list[dict]) -> None:
    for r in ranks:
        assert "the ranks passed different position dicts" in r["position"], r["position"]


def test_accumulation_with_unused_parameters_matches_one_process(ranks: list[dict]) -> None:
    torch.manual_seed(0)
    ref = Heads()
    loss = 0.0
    for rank in range(2):
        x, y = heads_data(rank)
        head = ref.a if rank == 0 else ref.b
        for i in range(2):  # the mean over 2 micro-batches and 2 ranks
            loss = loss + torch.nn.functional.cross_entropy(head(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4]) / 4
    loss.backward()
    with torch.no_grad():
        for q in ref.parameters():
            q -= q.grad
    for k, v in ref.state_dict().items():
        for r in ranks:
            assert torch.allclose(r["heads"][k], v, atol=1e-6), k
