"""Dataclass batches and outputs: O1/O2/O3 cast the tensors a ``@dataclass`` holds, as they cast tuples and dicts.

torch's pytree does not walk a dataclass it was not told about, so a model fed one got its tensors uncast.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

from overdrive import amp
from overdrive.amp.casting import cast_floating, tensor_leaves

BF16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Features:
    x: torch.Tensor  # (B, 4) float
    ids: torch.Tensor  # (B,) long


@dataclasses.dataclass
class Batch:
    feats: Features
    extra: dict[str, torch.Tensor]  # {"bias": (B, 3) float}
    n_seen: int = dataclasses.field(default=0, init=False)  # set after construction, not an __init__ argument
    post_inits: list[int] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.post_inits.append(1)


@dataclasses.dataclass(frozen=True)
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class Pair(NamedTuple):
    batch: Batch
    scale: torch.Tensor


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, b: Batch) -> Output:
        h = self.fc(b.feats.x)  # (B, 3); a dtype mismatch if b.feats.x is not the weights' dtype
        return Output(logits=h + b.extra["bias"], hidden=h)


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    b = Batch(Features(torch.randn(5, 4, generator=g), torch.arange(5)), {"bias": torch.randn(5, 3, generator=g)})
    b.n_seen = 7
    return b


def test_cast_floating_walks_dataclasses_nested_anywhere() -> None:
    b = _batch()
    tree = {"pair": Pair(b, torch.ones(2)), "list": [b.feats]}
    out = cast_floating(tree, BF16)
    cb = out["pair"].batch
    assert cb.feats.x.dtype == BF16 and cb.extra["bias"].dtype == BF16 and out["pair"].scale.dtype == BF16
    assert cb.feats.ids.dtype == torch.long and out["list"][0].x.dtype == BF16
    assert isinstance(cb, Batch) and isinstance(cb.feats, Features)  # same types, frozen one included
    assert cb.n_seen == 7 and cb.post_inits == [1]  # init=False field kept; __post_init__ not run again
    assert b.feats.x.dtype == torch.float32  # the caller's batch is left as it was
    torch.testing.assert_close(cb.feats.x.float(), b.feats.x, rtol=2**-8, atol=0)
    assert len(tensor_leaves(tree)) == 6  # x, ids, bias, scale, and x, ids again through the list
    nothing = Features(torch.zeros(1, dtype=torch.long), torch.arange(2))
    assert cast_floating(nothing, BF16) is nothing  # nothing to cast: the very object back


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_dataclass_batch_trains_at_every_level(level: str) -> None:
    torch.manual_seed(0)
    model = Model()
    ref = Model()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=BF16)
    b = _batch()
    out = model(b)  # O2/O3 raised "mat1 and mat2 must have the same dtype" on the uncast dataclass input
    assert isinstance(out, Output)
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.float32  # outputs cast, like a tuple's
    want = ref(b)
    torch.testing.assert_close(out.logits, want.logits, rtol=0.05, atol=0.05)  # bf16 matmul vs fp32
    loss = out.logits.square().mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(q).all() for q in amp.master_params(opt))


def test_o1_region_follows_a_dataclass_output_to_the_loss() -> None:
    """apex's O1 casts the ops between the forward and scale_loss; the region must see a dataclass's tensors as
    the forward's outputs, or it closes at the forward's end and the loss's matmul runs in fp32."""
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", dtype=BF16)
    out = model(_batch())
    proj = out.hidden @ torch.ones(3, 2)  # (B, 2): under O1's region, a bf16 matmul
    assert proj.dtype == BF16
    with amp.scale_loss(proj.float().square().mean(), opt) as scaled:
        scaled.backward()
    assert not torch.is_autocast_enabled("cpu")
    opt.step()
