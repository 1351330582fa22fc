"""Half-precision engines are checked against the model too (only int8/fp8 were): an fp16 engine whose activations overflow
fp16's 65504 returns inf where the model does not, and the build says so instead of handing back a wrong engine.
Reference: the fp32 module on the example inputs; tolerance: cosine 0.99 (Builder's min_cosine)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive.engine import Builder, ShapeProfile

pytest.importorskip("onnxruntime")


class _Overflow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1e5).sum(-1, keepdim=True) / 1e5  # 1e5-scale values: inf in fp16, finite in fp32


def test_a_sound_half_precision_engine_records_its_accuracy_and_stays_quiet() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eng = Builder(precision="fp16", device="cpu", profiles=(ShapeProfile.fixed("x", (3, 8)),)).build(
            model, (torch.randn(3, 8),), input_names=["x"])
    assert not [w for w in seen if "engine is off" in str(w.message)]
    acc = eng.info["accuracy"]
    assert acc["passed"] is True and acc["cosine"] > 0.999 and acc["on"] == "example inputs"


def test_an_overflowing_half_precision_engine_is_reported() -> None:
    # fp16 on CPU: the onnxruntime backend runs an fp16 model where its kernels allow; skip where no CPU fp16 build
    x = torch.rand(2, 8) + 1.0
    try:
        with pytest.warns(UserWarning, match=r"the fp16 engine is off the fp32 model: cosine .* build in bf16"):
            eng = Builder(precision="fp16", device="cpu", profiles=(ShapeProfile.fixed("x", (2, 8)),)).build(
                _Overflow(), (x,), input_names=["x"])
    except Exception as exc:  # noqa: BLE001 - a CPU without an fp16 path refuses the build itself
        if "fp16" in str(exc) and "warn" not in type(exc).__name__.lower():
            pytest.skip(f"no fp16 build on this CPU: {exc}")
        raise
    assert eng.info["accuracy"]["passed"] is False
