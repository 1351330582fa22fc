"""apex-style gradient accumulation under DDP (``no_sync`` / apex's ``disable_allreduce`` on the first micro-batch,
``amp.scale_loss(..., delay_unscale=True)``): every rank takes the step on the all-reduced gradient of both
micro-batches. Reference: one process, the mean over the ranks of both micro-batches' gradients (fp32), one SGD
step; tolerance 1e-6 at O0 and 2e-2 at O1/O2 (bf16 forward and gradients on CPU).

Before the fix the first micro-batch's gradients were kept aside during the synced backward, so only the last
micro-batch was all-reduced: the replicas differed by 0.09 after one step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import launch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _amp_accum_worker import batch, model  # noqa: E402
from _rank_env import worker_env  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("amp_accum")
    rc = launch(LaunchConfig(nproc_per_node=2), str(HERE / "_amp_accum_worker.py"), [str(out)], env=worker_env(),
                timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _reference() -> dict[str, torch.Tensor]:
    m = model()
    for rank in range(2):
        for i in range(2):
            x, y = batch(rank, i)
            (torch.nn.functional.cross_entropy(m(x), y) / 2 / 2).backward()  # / 2 micro-batches, / 2 ranks (mean)
    with torch.no_grad():
        for q in m.parameters():
            q -= 0.5 * q.grad
    return m.state_dict()


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
@pytest.mark.parametrize("wrapper", ["torch", "apex"])
def test_delayed_unscale_accumulation_all_reduces_every_micro_batch(ranks: list[dict], level: str, wrapper: str) -> None:
    r0, r1 = ranks[0][f"{level}-{wrapper}"], ranks[1][f"{level}-{wrapper}"]
    ref = _reference()
    tol = 1e-6 if level == "O0" else 2e-2
    for k in ref:
        assert torch.allclose(r0[k], r1[k], atol=tol / 10), f"{level} {wrapper}: {k} differs between the ranks"
        assert torch.allclose(r0[k], ref[k], atol=tol), f"{level} {wrapper}: {k} is not the reference step"
