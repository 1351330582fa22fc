"""``overdrive.apex.parallel.Reducer`` (apex's manual gradient average), 2 gloo ranks on CPU: a script written for
``from apex.parallel import Reducer`` had failed at the import. Built on a module whose weights differ per rank, it
starts every rank from rank 0's; gradients reduced every 2 micro-batches (or given as a list of ``.grad`` tensors)
give, after 2 SGD-momentum steps, the single-process full-batch parameters within 1e-6 on both ranks.
This file is also the 2-rank worker (run by the package's launcher, with a timeout so a hang fails)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).parent
STEPS, MICRO = 2, 2


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _micro(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(40 + rank)
    return [(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(STEPS * MICRO)]


def _reference() -> list[list[float]]:
    """One process, rank 0's initial weights, each step on both ranks' micro-batches at once (equal sizes)."""
    m = _model(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    data = [_micro(r) for r in (0, 1)]
    for s in range(STEPS):
        chunk = [b for r in (0, 1) for b in data[r][s * MICRO:(s + 1) * MICRO]]
        loss = nn.functional.cross_entropy(m(torch.cat([x for x, _ in chunk])), torch.cat([y for _, y in chunk]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [q.detach().flatten().tolist() for q in m.parameters()]


def _worker(out: str) -> None:
    from overdrive import distributed as odist
    from overdrive.apex.parallel import Reducer

    env = odist.init(device="cpu")
    result: dict[str, object] = {}
    for how in ("module", "grads"):
        m = _model(env.rank)  # different weights per rank: the module form broadcasts rank 0's
        if how == "grads":
            with torch.no_grad():  # the list form leaves the start to the caller, as apex did
                for q in m.parameters():
                    torch.distributed.broadcast(q, src=0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if how == "grads":  # the .grad tensors must exist and stay: zero them in place
            for q in m.parameters():
                q.grad = torch.zeros_like(q)
        reducer = Reducer(m) if how == "module" else Reducer([q.grad for q in m.parameters()])
        data = _micro(env.rank)
        for s in range(STEPS):
            opt.zero_grad(set_to_none=how == "module")
            for x, y in data[s * MICRO:(s + 1) * MICRO]:
                (nn.functional.cross_entropy(m(x), y) / MICRO).backward()
            reducer.reduce()
            opt.step()
        result[how] = [q.detach().flatten().tolist() for q in m.parameters()]
    Path(out, f"rank{env.rank}.json").write_text(json.dumps(result))
    odist.leave()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from overdrive.distributed import LaunchConfig
    from overdrive.distributed.launch import launch

    sys.path.insert(0, str(HERE))
    from _rank_env import worker_env

    out = tmp_path_factory.mktemp("reducer")
    rc = launch(LaunchConfig(nproc_per_node=2), str(Path(__file__)), [str(out)], env=worker_env(), timeout_s=240)
    assert rc == 0, f"torchrun exit code {rc} (a hang ends in the timeout)"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("how", ["module", "grads"])
def test_reducer_matches_the_full_batch_reference(ranks: list[dict], how: str) -> None:
    ref = _reference()
    for r, res in enumerate(ranks):
        for got, want in zip(res[how], ref):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6), (r, how)


def test_reducer_needs_a_process_group() -> None:
    from overdrive._utils.errors import UsageError
    from overdrive.apex.parallel import Reducer

    with pytest.raises(UsageError, match="needs a process group"):
        Reducer(nn.Linear(2, 2))


if __name__ == "__main__":
    _worker(sys.argv[1])
