"""The build-time accuracy check judges the worst sample too: one wrong sample among many right ones moves the mean
cosine little (one at 0.5 among 64 leaves it at 0.992, above the 0.99 tolerance) and must not pass."""

from __future__ import annotations

import math
from typing import Any

import torch

from overdrive._utils.fidelity import compare_outputs
from overdrive.engine import accuracy


def _one_bad_sample(n: int = 64, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, d) reference and an output equal to it except sample 7, turned 60 degrees away (cosine 0.5)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(n, d, generator=g, dtype=torch.float64)
    out = ref.clone()
    r = ref[7]
    ortho = torch.randn(d, generator=g, dtype=torch.float64)
    ortho -= (ortho @ r) / (r @ r) * r
    ortho *= r.norm() / ortho.norm()
    out[7] = 0.5 * r + math.sqrt(0.75) * ortho  # same norm, cosine 0.5 to r
    return ref.float(), out.float()


class _Engine:
    """The part of an Engine that ``accuracy.measure`` uses: ``run`` returns ``out`` whatever the input."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.header: dict[str, Any] = {"outputs": [{"name": "y"}]}
        self.profiles: list[Any] = []

    def run(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        return [self.out]


def test_compare_outputs_reports_the_worst_sample() -> None:
    ref, out = _one_bad_sample()
    r = compare_outputs([[ref]], [[out]], ["y"])
    assert r["cosine"] > 0.99  # the mean hides it
    assert abs(r["worst_cosine"] - 0.5) < 1e-4 and abs(r["outputs"]["y"]["worst_cosine"] - 0.5) < 1e-4


def test_one_far_sample_fails_the_check_and_says_so() -> None:
    ref, out = _one_bad_sample()
    rec = accuracy.measure(_Engine(out), lambda batch: [ref], "fp32", None, (torch.zeros(64, 16),), 0.99)
    assert rec["cosine"] >= 0.99 and rec["min_worst_cosine"] == 0.9
    assert rec["passed"] is False
    assert "worst sample 0.50000" in accuracy.summary(rec) and "BELOW" in accuracy.summary(rec)
    assert "cosine 0.5000 there" in accuracy.warning(rec, "int8")


def test_int8_rounding_on_every_sample_passes() -> None:
    """Per-tensor int8 rounding (absolute: a step of range / 255) on every sample, one of them near zero (a row a
    ReLU almost zeroed), where that rounding is all there is and the cosine is noise against noise."""
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(256, 16, generator=g)
    ref[3] *= 1e-3
    step = float(ref.max() - ref.min()) / 255
    out = ref + step / 12**0.5 * torch.randn(256, 16, generator=g)
    assert compare_outputs([[ref[3:4]]], [[out[3:4]]], ["y"])["cosine"] < 0.5  # that sample alone is far off
    rec = accuracy.measure(_Engine(out), lambda batch: [ref], "fp32", None, (torch.zeros(256, 16),), 0.99)
    assert rec["passed"] is True and rec["worst_cosine"] > 0.99, rec


def test_the_floor_turns_off_with_the_check() -> None:
    ref, out = _one_bad_sample()
    out[7] = -ref[7]
    rec = accuracy.measure(_Engine(out), lambda batch: [ref], "fp32", None, (torch.zeros(64, 16),), -1.0)
    assert rec["worst_cosine"] == -1.0 and rec["passed"] is True
