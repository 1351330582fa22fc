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


def _onnx_mlp() -> bytes:
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    buf = io.BytesIO()
    torch.onnx.export(model, (torch.randn(3, 8),), buf, input_names=["x"], dynamo=False)
    return buf.getvalue()


def test_an_fp32_engine_from_onnx_is_checked_against_onnx_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 engine was never compared with its model: a fault in the ONNX import or a graph rewrite shipped
    silently. Here the importer's Relu is broken on purpose (an identity); the build must say the engine is off."""
    data, x = _onnx_mlp(), torch.randn(3, 8)
    cfg = dict(precision="fp32", device="cpu", backend="inductor", aot=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eng = Builder(**cfg).build(data, (x,))
    assert not [w for w in seen if "engine is off" in str(w.message)]
    acc = eng.info["accuracy"]
    assert acc["passed"] is True and acc["cosine"] > 0.9999 and acc["vs"] == "ONNX Runtime"

    from overdrive.engine.onnx import importer

    monkeypatch.setitem(importer._OPS, "Relu", lambda m, ins, a: [ins[0]])
    with pytest.warns(UserWarning, match=r"the fp32 engine is off the ONNX Runtime model: cosine .* a fault in the build"):
        eng = Builder(**cfg).build(data, (torch.randn(3, 8),))
    assert eng.info["accuracy"]["passed"] is False
