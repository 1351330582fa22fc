"""Quantizers traced by torch.export run fake quantization as plain arithmetic (export has no kernel
for aten._fake_quantize_*_cachemask). Reference: the eager fake-quant of the same quantizer; tolerance 0
(the same operations in the same order). An int8 engine of a model with a quantized residual add builds
with the inductor backend (it failed in torch.export before, on CUDA and on CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive.quant.quantizer import TensorQuantizer


@pytest.mark.parametrize("axis,narrow", [(None, False), (None, True), (0, True), (1, False)])
def test_export_arithmetic_equals_eager(axis: int | None, narrow: bool) -> None:
    torch.manual_seed(axis or 0)
    x = torch.randn(8, 16, 5) * 3
    cfg = quant.QuantizerConfig(format="int8", per_channel=axis is not None, narrow_range=narrow)
    q = TensorQuantizer(cfg, axis=axis)
    amax = x.abs().amax(dim=[d for d in range(3) if d != axis]) if axis is not None else x.abs().max()
    q.amax = amax * 0.7  # values past amax: the clamp is exercised too
    eager = q(x)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = q

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.q(t)

    with torch.no_grad():
        ep = torch.export.export(M(), (x,), strict=False)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("fake_quantize" in o for o in ops), ops
    y = ep.module()(torch.clone(x))
    assert torch.equal(y, eager)


class _Res(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc((x + self.conv(x)).mean((2, 3)))


@pytest.mark.slow
def test_int8_inductor_engine_builds_with_residual_add() -> None:
    from overdrive.engine import Builder

    torch.manual_seed(0)
    model = _Res().eval()
    calib = [(torch.randn(4, 8, 6, 6),) for _ in range(2)]
    eng = Builder(precision="int8", device="cpu", backend="inductor").build(model, calib[0], calib=calib)
    x = torch.randn(4, 8, 6, 6)
    with torch.no_grad():
        ref = model(x)
    assert (eng(x) - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_cuda_engine_with_dynamic_batch_builds() -> None:
    """_int_mm needs M > 16 on CUDA; the padding must not branch on a symbolic batch under torch.export
    (the quick demo's int8 engine, batch profile 1..64, failed to build on the H200)."""
    from overdrive.engine import Builder, ShapeProfile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    calib = [(torch.randn(64, 32),) for _ in range(2)]
    prof = [ShapeProfile("x", (1, 32), (64, 32), (64, 32))]
    eng = Builder(precision="int8", device="cuda", profiles=prof).build(model, calib=calib)
    for b in (1, 5, 64):
        x = torch.randn(b, 32)
        with torch.no_grad():
            ref = model(x)
        out = eng(x.cuda()).float().cpu()
        assert out.shape == ref.shape and (out - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


class _Block(nn.Module):
    """A transformer-style block: two residual adds around Linear layers, LayerNorm reading the sums."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x + self.fc1(x))
        return self.ln(h + self.fc2(torch.relu(h)))


def test_residual_quantizers_no_kernel_reads_are_dropped() -> None:
    """An int8 engine with no int8/fp8 convolution to take an 8-bit residual (a transformer; any CPU build) turns the
    residual-add quantizers its calibration placed into plain adds, counted in backend_meta. A model quantized already
    (the same calibration, by the user) keeps its own, and that engine is further from the fp32 model (reference: the
    fp32 module; the difference is the residuals' int8 rounding)."""
    from overdrive.engine import Builder

    torch.manual_seed(0)
    model = _Block().eval()
    calib = [(torch.randn(64, 32) * 3,) for _ in range(2)]
    x = torch.randn(64, 32) * 3
    with torch.no_grad():
        ref = model(x)
    cfg = dict(precision="int8", device="cpu", backend="inductor", layer_precision="all", int8_activations="static")
    eng = Builder(**cfg).build(model, calib[0], calib=calib)
    assert eng.header["backend_meta"]["residual_quantizers_dropped"] == 2

    def loop(m: nn.Module) -> None:
        with torch.no_grad():
            for (b,) in calib:
                m(b)

    mine = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT, loop, fidelity=False)
    kept = Builder(**cfg).build(mine, calib[0], calib=calib)
    assert "residual_quantizers_dropped" not in kept.header["backend_meta"]
    assert (eng(x) - ref).abs().max().item() < (kept(x) - ref).abs().max().item()
