"""The onnxruntime backend's int8 layout for float models (engine/backends/onnxruntime.py, choose_int8_layout).

Before, every static int8 engine of a float model on ONNX Runtime had Q/DQ on the inputs of its convolutions only.
ONNX Runtime has no integer convolution that returns float, so each convolution ran in fp32 behind a
DequantizeLinear: the CPU demo's ResNet ran its int8 engine 0.4x its fp32 engine, with no QLinearConv in the
graph. Now ONNX Runtime's own layout (outputs, adds and pooling quantized too) is calibrated beside it, both are
timed at build time, and the faster one that keeps cosine >= 0.99 to the fp32 model is kept. Timing decides the
choice, so the tests pin it with ``INTEGER_LAYOUT_GAIN`` (0: the integer layout wins any race; inf: it never does)
and check what each choice builds. References: the fp32 model (cosine), ONNX Runtime on the same Q/DQ model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from overdrive.engine import Builder, ShapeProfile
from overdrive.engine.backends import onnxruntime as ortb
from overdrive.engine.onnx import quantize_onnx_integer
from overdrive.recipes.models import ResNet

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not ortb.int8_kernels_exact()[0],
                                reason="ONNX Runtime's int8 kernels are not exact on this CPU: only one layout is tried")

SHAPE = (8, 1, 16, 16)


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    m = ResNet(16, (1, 1), "small").eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):  # non-trivial statistics, so folding is exercised
                mod.running_mean.uniform_(-0.2, 0.2)
                mod.running_var.uniform_(0.5, 2.0)
    return m


def _calib() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*SHAPE, generator=g),) for _ in range(4)]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _build(model: nn.Module | bytes) -> object:
    return Builder(precision="int8", backend="onnxruntime", device="cpu",
                   profiles=[ShapeProfile.fixed("x", SHAPE)]).build(model, calib=_calib())


def test_integer_layout_runs_convolutions_on_integer_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ortb, "INTEGER_LAYOUT_GAIN", 0.0)  # the integer layout wins any race it is accurate for
    model = _resnet()
    eng = _build(model)
    meta = eng.header["backend_meta"]
    assert meta["int8_layout"] == "integer", meta.get("int8_layout_why")
    n_conv = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert meta["int8_ops"].get("QLinearConv") == n_conv  # every convolution in int8, none in float behind a DQ
    assert set(meta["int8_layouts"]) == {"inputs", "integer"} and meta["int8_layouts"]["integer"]["cosine"] >= 0.99
    from overdrive.engine.int8 import summary

    assert "integer Q/DQ layout (integer layout" in summary(eng.header["int8"])  # overdrive build's line says which
    x = _calib()[0][0]
    with torch.no_grad():
        ref = model(x)
    out = eng(x)
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert _cos(out, ref) >= 0.99  # int8 error against fp32
    assert eng.header["accuracy"]["passed"] is True


def test_inputs_layout_is_kept_when_the_integer_one_is_not_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ortb, "INTEGER_LAYOUT_GAIN", math.inf)
    eng = _build(_resnet())
    meta = eng.header["backend_meta"]
    assert meta["int8_layout"] == "inputs" and "integer layout" in meta["int8_layout_why"]
    assert "QLinearConv" not in meta["int8_ops"]  # the inputs-only layout: convolutions behind DequantizeLinear


def test_an_inaccurate_integer_layout_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout that is fast but wrong must lose: here its weights are zeroed, so its outputs are constant."""
    import onnx
    from onnx import numpy_helper

    def broken(fp32: bytes, calib: list) -> bytes:
        m = onnx.load_from_string(quantize_onnx_integer(fp32, calib))
        for t in m.graph.initializer:
            if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 4:
                t.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(t)), t.name))
        return m.SerializeToString()

    monkeypatch.setattr(ortb, "INTEGER_LAYOUT_GAIN", 0.0)
    monkeypatch.setattr("overdrive.engine.onnx.quantize_onnx_integer", broken)
    eng = _build(_resnet())
    meta = eng.header["backend_meta"]
    assert meta["int8_layout"] == "inputs"
    assert meta["int8_layouts"]["integer"]["cosine"] < 0.99 and "less accurate, not used" in meta["int8_layout_why"]


def test_float_onnx_and_module_sources_choose_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float ONNX file takes the same path as the module (trtexec --onnx --int8 --calib)."""
    from overdrive.engine.sources import from_module

    monkeypatch.setattr(ortb, "INTEGER_LAYOUT_GAIN", 0.0)
    model = _resnet()
    onnx_bytes = from_module(model).as_onnx((torch.randn(*SHAPE),), [ShapeProfile.fixed("x", SHAPE)])
    eng = _build(onnx_bytes)
    assert eng.header["backend_meta"]["int8_layout"] == "integer"
    assert "integer" in eng.header["calibration"]
    x = _calib()[1][0]
    with torch.no_grad():
        ref = model(x)
    out = eng(x)
    assert _cos(out[0] if isinstance(out, (list, tuple)) else out, ref) >= 0.99


def test_models_without_convolutions_keep_one_layout() -> None:
    """Transformers keep the inputs-only layout (integer GEMMs, the residual stream float) without a second
    calibration: the integer layout quantizes the residual stream, which costs them accuracy."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    g = torch.Generator().manual_seed(2)
    calib = [(torch.randn(8, 32, generator=g),) for _ in range(2)]
    eng = Builder(precision="int8", backend="onnxruntime", device="cpu",
                  profiles=[ShapeProfile.fixed("x", (8, 32))]).build(mlp, calib=calib)
    meta = eng.header["backend_meta"]
    assert meta["int8_layout"] == "inputs" and "int8_layouts" not in meta
    assert "no convolutions" in meta["int8_layout_why"]


def test_float_convolutions_are_counted_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 engine whose convolutions stay float (the inputs-only layout, as QAT models export) says so."""
    from overdrive.engine.int8 import summary

    monkeypatch.setattr(ortb, "INTEGER_LAYOUT_GAIN", math.inf)
    model = _resnet()
    eng = _build(model)
    n_conv = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert eng.header["backend_meta"]["float_convs"] == n_conv
    assert f"{n_conv} convolution(s) run in float behind DequantizeLinear" in summary(eng.header["int8"])
    monkeypatch.setattr(ortb, "INTEGER_LAYOUT_GAIN", 0.0)
    eng = _build(model)
    assert "float_convs" not in eng.header["backend_meta"] and "run in float" not in summary(eng.header["int8"])
