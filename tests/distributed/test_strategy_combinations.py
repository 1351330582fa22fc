"""Strategy settings combined as users combine them, on a group of one in this process: DDP ``static_graph`` with
gradient accumulation, and FSDP2 at O2 bf16 on a model whose BatchNorm is a block of its own (a child of
``nn.Sequential`` or of the root). Both had failed inside torch on the first step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive.amp import Policy
from overdrive.distributed import Strategy
from overdrive.train import Trainer


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _reference(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    """Plain fp32 training, one full batch per step, SGD with momentum."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    return ref


def test_ddp_static_graph_with_accumulation_trains(group: None) -> None:
    # every micro-batch runs in no_sync: DDP's static graph then failed its first backward with
    # "expect_autograd_hooks_ INTERNAL ASSERT FAILED"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    batches = _batches(3)
    want = _reference(model, batches).state_dict()
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                strategy=Strategy(kind="ddp", static_graph=True), accumulate=2, progress=False)
    for x, y in batches:
        t.train_step((x[:4], y[:4]))
        t.train_step((x[4:], y[4:]))
    got = model.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", ["sequential", "root_child"])
def test_fsdp_o2_bf16_with_batchnorm_as_a_block(group: None, layout: str) -> None:
    # BatchNorm is sharded on its own in fp32 under O2/O3; as a block of the default per-block sharding it was
    # sharded a second time: "fully_shard can only be applied to a module once"
    torch.manual_seed(0)
    if layout == "sequential":
        model: nn.Module = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    else:
        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.l1, self.bn, self.l2 = nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 6) -> (B, 3)
                return self.l2(torch.relu(self.bn(self.l1(x))))

        model = Net()
    batches = _batches(2)
    ref = _reference(model, batches)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                policy=Policy(opt_level="O2", dtype=torch.bfloat16), strategy="fsdp", progress=False)
    for b in batches:
        t.train_step(b)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    got = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    want = ref.state_dict()
    assert set(got) == set(want)
    for k in want:  # bf16 compute against the fp32 reference (README: within 3e-2)
        assert got[k].dtype == want[k].dtype, k  # the norm's weights and running stats stay fp32
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=0, atol=3e-2)
