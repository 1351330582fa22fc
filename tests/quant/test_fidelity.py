"""quantize() measures what it did on the user's own data: the outputs on the first calibration batches against the
float model (reference: a deep copy of the float model taken before quantize, run on the same batches; tolerance
1e-6 on the cosine), and the user's own metric through ``validate=`` before and after."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from rich.console import Console
from torch import nn

from overdrive import quant
from overdrive.quant import fidelity


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def _batches(n: int = 6, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1).mean())


def test_fidelity_is_the_quantized_model_against_the_float_one_on_the_first_batches() -> None:
    model, xs = _mlp(), _batches()
    ref = copy.deepcopy(model)
    q = quant.quantize(model, quant.INT8_DEFAULT, lambda m: [m(x) for x in xs])
    rec = quant.summary(q)["fidelity"]
    assert rec["on"] == "calibration data" and rec["batches"] == fidelity.MAX_BATCHES
    with torch.no_grad():
        kept = torch.cat(xs[:fidelity.MAX_BATCHES])
        want = _cosine(ref(kept), q(kept))  # the mean over samples, as the record
    assert rec["cosine"] == pytest.approx(want, abs=1e-6) and 0.9 < rec["cosine"] < 1.0
    assert rec["rel_max_err"] > 0


def test_a_broken_range_shows_in_the_record() -> None:
    """The measurement can fail: an input range 100x too small clips the activations, and the cosine says so."""
    xs = _batches()
    q = quant.quantize(_mlp(), quant.INT8_DEFAULT, lambda m: [m(x) for x in xs])
    good = quant.summary(q)["fidelity"]["cosine"]
    with torch.no_grad():
        q[0].input_quantizer.amax.mul_(0.01)
    bad = fidelity.measure(q, [((x,), {}) for x in xs[:2]])
    assert good > 0.999 and bad["cosine"] < 0.95


def test_validate_reports_the_users_metric_before_and_after() -> None:
    model, xs = _mlp(), _batches()
    target = [torch.randn(8, 8, generator=torch.Generator().manual_seed(2)) for _ in xs]

    def mse(m: nn.Module) -> float:
        assert not m.training and not torch.is_grad_enabled()
        return sum(float(((m(x) - t) ** 2).mean()) for x, t in zip(xs, target))

    with torch.no_grad():
        float_mse = sum(float(((model(x) - t) ** 2).mean()) for x, t in zip(xs, target))
    q = quant.quantize(model, quant.INT8_DEFAULT, lambda m: [m(x) for x in xs], validate=mse)
    v = quant.summary(q)["validate"]
    with torch.no_grad():
        quant_mse = sum(float(((q(x) - t) ** 2).mean()) for x, t in zip(xs, target))
    assert v["float"] == pytest.approx(float_mse, rel=1e-9) and v["quantized"] == pytest.approx(quant_mse, rel=1e-9)
    assert v["delta"] == pytest.approx(quant_mse - float_mse, rel=1e-6, abs=1e-12)
    out = io.StringIO()
    quant.print_summary(q, Console(file=out, width=200))
    text = out.getvalue()
    assert "calibration batch(es): output cosine" in text and "validate:" in text and "float ->" in text


def test_dynamic_scales_measure_without_running_the_whole_loop() -> None:
    """INT8_DYNAMIC calibrates nothing: the loop runs once more, only until the batches are kept."""
    xs, calls = _batches(10), []

    def loop(m: nn.Module) -> None:
        for x in xs:
            calls.append(1)
            m(x)

    q = quant.quantize(_mlp(), quant.INT8_DYNAMIC, loop)
    rec = quant.summary(q)["fidelity"]
    assert rec["batches"] == fidelity.MAX_BATCHES and len(calls) == fidelity.MAX_BATCHES and rec["cosine"] > 0.999


def test_fidelity_off_and_the_output_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    xs = _batches()
    q = quant.quantize(_mlp(), quant.INT8_DEFAULT, lambda m: [m(x) for x in xs], fidelity=False)
    assert quant.summary(q)["fidelity"] is None
    monkeypatch.setattr(fidelity, "MAX_ELEMENTS", 8 * 8 * 2)  # two batches of (8, 8) outputs
    q = quant.quantize(_mlp(), quant.INT8_DEFAULT, lambda m: [m(x) for x in xs])
    assert quant.summary(q)["fidelity"]["batches"] == 2
    q = quant.quantize(_mlp(), quant.INT8_DEFAULT)  # no data: nothing to measure on
    assert quant.summary(q)["fidelity"] is None


def test_keyword_inputs_are_kept_too() -> None:
    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, *, features: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.fc(features)}

    xs = _batches(2)
    torch.manual_seed(0)
    q = quant.quantize(Kw().eval(), quant.INT8_DEFAULT, lambda m: [m(features=x) for x in xs])
    rec = quant.summary(q)["fidelity"]
    assert rec["batches"] == 2 and rec["cosine"] > 0.99 and rec["top1"] is not None
