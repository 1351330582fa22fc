"""FSDP2 through ``Strategy`` on models a hand-written ``fully_shard`` script trains, and clear errors for models
``strategy=`` cannot wrap (a group of one in this process).

2 ranks (torchrun runs this file as a script): a model with tied weights (embedding and LM head, both children of
the root) failed ("shared with a parameter already managed by another FSDP group"); ``fsdp_blocks`` naming a class
nested in itself failed inside torch ("Invariant encountered"). Each rank writes its full parameters after two
SGD-momentum steps on its half of the batch, and the full state dict gathered for saving; both equal the
one-process full-batch reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.distributed import LaunchConfig, Parallel, Strategy
from overdrive.distributed.launch import launch
from overdrive.train import Trainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _rank_env import worker_env  # noqa: E402

V, D = 11, 8


class TiedLM(nn.Module):
    """Embedding -> Linear -> head whose weight is the embedding's (as GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, V)
        return self.head(torch.tanh(self.mid(self.emb(x))))


class Block(nn.Module):
    """A block holding another block (``fsdp_blocks=("Block",)`` matches both)."""

    def __init__(self, inner: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.inner = Block(inner=False) if inner else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin(x))
        return self.inner(x) if self.inner is not None else x


def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return TiedLM() if name == "tied" else nn.Sequential(Block(), nn.Linear(8, 3))


def batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    if name == "tied":
        return torch.randint(0, V, (6,), generator=g), torch.randint(0, V, (6,), generator=g)
    return torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


STRATEGIES = {"tied": Strategy(kind="fsdp"), "nested": Strategy(kind="fsdp", fsdp_blocks=("Block",))}


def worker(out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    env = odist.init(device="cpu")
    results = {}
    for name, strategy in STRATEGIES.items():
        m = model(name)
        tr = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9), progress=False, strategy=strategy)
        for step in range(2):
            tr.train_step(batch(name, env.rank, step))
        params = {n: q.full_tensor().detach().clone() for n, q in tr.model.named_parameters()}
        saved = get_model_state_dict(tr.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        results[name] = {"params": params, "saved": saved}
    torch.save(results, f"{out}/rank{env.rank}.pt")
    odist.leave()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("probe4")
    rc = launch(LaunchConfig(nproc_per_node=2), str(Path(__file__)), [str(out)], env=worker_env(),
                timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def reference(name: str) -> nn.Module:
    """The plain one-process loop on both ranks' batches at once (each rank's batch the same size: the same mean)."""
    m = model(name)
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    for step in range(2):
        xs, ys = zip(*(batch(name, r, step) for r in range(2)))
        nn.functional.cross_entropy(m(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return m


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_fsdp_trains_tied_and_nested_models_as_the_reference(ranks: list[dict], name: str) -> None:
    ref = reference(name)
    want = dict(ref.named_parameters())
    for r in range(2):
        got = ranks[r][name]["params"]
        assert got.keys() == want.keys()
        for k, q in want.items():  # measured 1.2e-7
            assert torch.allclose(got[k], q.detach(), atol=1e-6), f"{name} rank {r}: {k} is not the reference"
    saved, full = ranks[0][name]["saved"], ref.state_dict()
    assert saved.keys() == full.keys()
    for k in full:
        assert torch.allclose(saved[k], full[k], atol=1e-6), f"{name}: saved {k} is not the reference"
    if name == "tied":  # the tie survives sharding: one tensor, stepped once per step
        assert torch.equal(ranks[0][name]["params"]["emb.weight"], saved["head.weight"])


def _plain() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_models_that_cannot_be_wrapped_raise_a_usage_error(group: None, kind: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_plain())
    with pytest.raises(UsageError, match=r"already wrapped in DistributedDataParallel.*ddp_model\.module"):
        Trainer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), progress=False, strategy=kind)
    sharded = _plain()
    fully_shard(sharded)
    with pytest.raises(UsageError, match=r"already sharded with fully_shard \(\(the root\)\)"):
        Trainer(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), progress=False, strategy=kind)
    with torch.device("meta"):
        meta = _plain()
    with pytest.raises(UsageError, match=r"4 parameter\(s\) are on the meta device \(0\.weight.*to_empty"):
        Parallel(kind, torch.device("cpu")).before_amp(meta, torch.optim.SGD(meta.parameters(), lr=0.1), "O0")


if __name__ == "__main__":  # one of the 2 torchrun ranks the ``ranks`` fixture starts
    worker(sys.argv[1])
