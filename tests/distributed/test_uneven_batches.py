"""``Trainer.fit`` under DDP / FSDP2 with a different number of batches on each rank: every rank raises the same
UsageError before the epoch's first step (see ``_uneven_batches_worker.py``), and the trainer stays usable."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import launch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _rank_env import worker_env  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("uneven")
    rc = launch(LaunchConfig(nproc_per_node=2), str(HERE / "_uneven_batches_worker.py"), [str(out)], env=worker_env(),
                timeout_s=300)
    assert rc == 0, f"torchrun exit code {rc}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_uneven_batch_counts_raise_on_every_rank(ranks: list[dict], strategy: str) -> None:
    for r, res in enumerate(ranks):
        msg = res[strategy]
        assert msg is not None, f"rank {r} trained through uneven data under {strategy}"
        assert f"this rank ({r}) has {3 if r == 0 else 2} training batches" in msg and "between 2 and 3" in msg
        assert "DistributedSampler" in msg
        assert res[f"{strategy}_steps_before"] == 0  # raised before the first step
        assert res[f"{strategy}_steps_after"] == 2
