"""int8 engines the build-time accuracy check must not pass: calibrated on degenerate data (all-zero or constant
inputs, copies of one sample), whose scales fit that one input and whose agreement there says nothing about real
inputs; and models whose only output is an integer (an argmax), which the cosine leaves out.

Reference: the fp32 PyTorch module, run on fresh random inputs here to show the engine is wrong on real data."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive._utils.errors import OverdriveError
from overdrive.engine import Builder
from overdrive.engine.accuracy import degenerate, summary

pytest.importorskip("onnxruntime")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).eval()


class _Argmax(nn.Module):
    """A classifier returning labels, (B,) int64. One hidden unit 2000x the rest sets the per-tensor int8 scale of
    the hidden activations and does not reach the logits, so static int8 rounds what decides the label to zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 10)
        with torch.no_grad():
            self.a.weight[0] *= 2000.0
            self.b.weight[:, 0] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).argmax(1)


def _random(n: int, seed: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g),) for _ in range(n)]


def _build(model: nn.Module, calib: list[tuple[torch.Tensor, ...]], **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = Builder(precision="int8", backend="onnxruntime", device="cpu", int8_activations="static",
                      **kw).build(model, (torch.randn(8, 16),), calib=calib)
    return eng, [str(w.message) for w in caught]


@pytest.mark.parametrize("calib", [[(torch.zeros(8, 16),)] * 4, [(torch.full((8, 16), 0.5),)] * 2,
                                   [(torch.randn(1, 16, generator=torch.Generator().manual_seed(3)).repeat(8, 1),)] * 2],
                         ids=["zeros", "constant", "one-sample-copied"])
def test_degenerate_calibration_fails_the_check(calib: list[tuple[torch.Tensor, ...]]) -> None:
    model = _mlp()
    eng, caught = _build(model, calib)
    real = _random(1, 7)[0][0]
    with torch.no_grad():
        off = float(torch.nn.functional.cosine_similarity(eng.run(real)[0], model(real), dim=1).mean())
    assert off < 0.99  # the engine is wrong on real inputs ...
    acc = eng.info["accuracy"]
    assert acc["cosine"] > 0.999  # ... though it agrees on the data it was calibrated with
    assert acc["passed"] is False and acc["degenerate"]
    assert any("degenerate data" in m and "--calib" in m for m in caught)
    assert "NOT A CHECK" in summary(acc)
    with pytest.raises(OverdriveError, match="degenerate data"):
        _build(model, calib, on_low_accuracy="raise")


def test_varied_calibration_still_passes() -> None:
    eng, caught = _build(_mlp(), _random(4, 1))
    assert eng.info["accuracy"]["passed"] is True and "degenerate" not in eng.info["accuracy"]
    assert not any("degenerate" in m for m in caught)


def test_degenerate_spares_constant_masks_beside_varied_ids() -> None:
    g = torch.Generator().manual_seed(0)
    ids_and_mask = [(torch.randint(0, 100, (4, 16), generator=g), torch.ones(4, 16, dtype=torch.int64))]
    assert degenerate(ids_and_mask) is None
    assert degenerate([(torch.zeros(4, 16, dtype=torch.int64), torch.ones(4, 16, dtype=torch.int64))])
    assert degenerate([(torch.randn(1, 16),)]) is None  # one sample: its values vary


def test_integer_output_is_checked_by_agreement() -> None:
    model = _Argmax().eval()
    calib = _random(4, 1)
    eng, caught = _build(model, calib)
    with torch.no_grad():
        same = float((eng.run(calib[0][0])[0] == model(calib[0][0])).double().mean())
    assert same < 0.9  # the engine's labels are wrong
    acc = eng.info["accuracy"]
    assert acc["by"] == "agreement" and acc["passed"] is False and acc["cosine"] < 0.9
    assert acc["outputs"]["output"]["agreement"] == acc["cosine"]
    assert any("integer/bool outputs agree" in m for m in caught)
    assert summary(acc).startswith("vs fp32 on 4 batch(es) of calibration data: agreement")


def test_best_says_why_it_rejects_a_degenerately_calibrated_int8() -> None:
    # --best rejected the candidate with "cosine 1.0000 < 0.99", which reads as a contradiction: it names the data now
    from overdrive.engine import ShapeProfile

    x = torch.zeros(8, 16)
    eng = Builder(precision="best", device="cpu", profiles=(ShapeProfile.fixed("x", (8, 16)),)).build(
        _mlp(), (torch.randn(8, 16),), input_names=["x"], calib=[(x,)])
    why = eng.header["best"]["rejected"]["int8"]
    assert why.startswith("calibration data unfit to judge it: every calibration input is one constant"), why
    assert eng.header["precision"] == "fp32"
