"""quantize()'s fidelity record for a model that takes and returns a user's ``@dataclass``: measured as for tensors.

torch's pytree hands an unregistered dataclass over whole: its output held no tensor to compare (the record was
silently missing), and its inputs were kept by reference, so a loader that refills one batch object in place had
every kept call measured on the last batch. Reference: a deep copy of the float model taken before quantize, on
the same batches; tolerance 1e-6 on the cosine."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive.quant import fidelity


@dataclasses.dataclass
class Features:
    x: torch.Tensor  # (B, 16)
    names: list[str]


@dataclasses.dataclass(frozen=True)
class Scores:
    logits: torch.Tensor  # (B, 8)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, f: Features) -> Scores:
        return Scores(self.body(f.x))


def _xs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(6)]


def test_the_record_compares_a_dataclass_output_on_dataclass_inputs() -> None:
    model, xs = Classifier().eval(), _xs()
    ref = copy.deepcopy(model)
    q = quant.quantize(model, quant.INT8_DEFAULT, lambda m: [m(Features(x, ["a"] * 8)) for x in xs])
    rec = quant.summary(q)["fidelity"]  # was None: the output held no tensor to compare
    assert rec is not None and rec["batches"] == fidelity.MAX_BATCHES
    kept = Features(torch.cat(xs[:fidelity.MAX_BATCHES]), [])
    with torch.no_grad():
        want = float(nn.functional.cosine_similarity(ref(kept).logits.double(), q(kept).logits.double(), dim=1).mean())
    assert rec["cosine"] == pytest.approx(want, abs=1e-6) and 0.9 < rec["cosine"] < 1.0
    assert rec["top1"] is not None  # one (B, C) output: a classifier's agreement


def test_kept_dataclass_inputs_are_copies_not_the_loaders_reused_buffer() -> None:
    model, xs = Classifier().eval(), _xs()
    buf = Features(torch.empty(8, 16), ["a"] * 8)  # a loader that refills one pinned batch in place
    with fidelity.capture(model) as calls, torch.no_grad():
        for x in xs[:3]:
            buf.x.copy_(x)
            model(buf)
    assert len(calls) == 3
    for (args, _), x in zip(calls, xs):
        assert isinstance(args[0], Features) and args[0].names == ["a"] * 8
        torch.testing.assert_close(args[0].x, x, rtol=0, atol=0)
