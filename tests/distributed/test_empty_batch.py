"""A batch of no samples on one rank (overdrive.data's batch whose files were all undecodable): every rank
takes the same step, on the mean of the ranks' gradients with a zero gradient for the empty one.

Before the fix rank 0 reported a NaN loss, skipped the step and rank 1 applied it: the replicas differed by
up to 0.03 after one SGD step (measured with overdrive.data's loader on a folder with corrupt files)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import launch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _empty_batch_worker import batch, model  # noqa: E402
from _rank_env import worker_env  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("empty_batch")
    rc = launch(LaunchConfig(nproc_per_node=2), str(HERE / "_empty_batch_worker.py"), [str(out)], env=worker_env(),
                timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_empty_batch_on_one_rank_keeps_the_replicas_equal(ranks: list[dict], strategy: str) -> None:
    r0, r1 = ranks[0][strategy], ranks[1][strategy]
    assert r0["skipped"] == r1["skipped"] == 0
    assert r0["loss"] != r0["loss"]  # NaN: the mean over no samples
    # the reference: one process, rank 1's batch, its gradient halved (the mean with rank 0's zero gradient)
    m = model()
    x, y = batch(1)
    torch.nn.functional.cross_entropy(m(x), y).backward()
    with torch.no_grad():
        for q in m.parameters():
            q -= 0.5 * q.grad / 2
    ref = m.state_dict()
    for k in ref:
        assert torch.equal(r0["params"][k], r1["params"][k]), f"{strategy}: {k} differs between the ranks"
        assert torch.allclose(r0["params"][k], ref[k], atol=1e-6), f"{strategy}: {k} is not the reference step"
