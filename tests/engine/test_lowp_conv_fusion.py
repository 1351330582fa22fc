"""int8/fp8 convolution chains (engine/lowp_conv_fusion.py): BatchNorm, residual, ReLU and the next quantize folded
into overdrive::conv2d_q. On CPU the op runs its fp32 reference, so the rewritten program must compute what the
unfused modules compute; on the GPU an int8/fp8 engine of a CNN runs the Triton kernels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from overdrive.engine.lowp_conv_fusion import fuse_lowp_convs
from overdrive.quant.conv import Fp8Conv2d, Int8Conv2d

from .test_conv_fusion import Bottleneck, _randomize_bn

CL = torch.channels_last


def _quantized(m: nn.Module, cls: type, x: torch.Tensor) -> nn.Module:
    """``m`` with every Conv2d replaced by ``cls`` calibrated on ``x`` (max calibration of each conv's input)."""
    m = copy.deepcopy(m)
    amax: dict[str, torch.Tensor] = {}
    hooks = [c.register_forward_pre_hook(lambda mod, a, n=n: amax.__setitem__(n, a[0].abs().amax()))
             for n, c in m.named_modules() if isinstance(c, nn.Conv2d)]
    with torch.no_grad():
        m(x)
    for h in hooks:
        h.remove()
    for n, c in list(m.named_modules()):
        if isinstance(c, nn.Conv2d):
            parent, _, leaf = n.rpartition(".")
            setattr(m.get_submodule(parent) if parent else m, leaf, cls.from_float(c, amax[n]))
    return m


@pytest.mark.parametrize("cls", [Int8Conv2d, Fp8Conv2d])
def test_bottlenecks_fold_and_quantize_outputs_same_function(cls) -> None:
    torch.manual_seed(0)
    m = _randomize_bn(nn.Sequential(Bottleneck(c=16, down=True), Bottleneck(c=32))).eval()
    x = torch.randn(2, 16, 12, 12).contiguous(memory_format=CL)
    q = _quantized(m, cls, x).eval()
    with torch.no_grad():
        want = q(x)
        ep = torch.export.export(q, (x,))
        counts = fuse_lowp_convs(ep)
        got = ep.module()(x)
    # 4 convs per block, each with its BatchNorm; c1 -> c2 -> c3 hand over quantized tensors; the block inputs (read
    # by c1 and the shortcut, two scales) are quantized by inlined ATen ops
    assert counts == {"folded": 8, "quantized_out": 4, "inlined": 4}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.overdrive.quantize.default not in targets
    assert not any(t in (torch.ops.aten.relu.default, torch.ops.aten.relu_.default, torch.ops.aten.add_.Tensor)
                   for t in targets)
    # the same arithmetic in another order (BatchNorm folded into the scale): equal to fp32 rounding, except where a
    # value at an 8-bit rounding boundary flips one step; the reference: the unfused quantized modules
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() > 0.9999
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_a_conv_read_by_other_ops_keeps_a_float_output() -> None:
    # the first conv's output is quantized for the second and also read by the add: it stays fp16/fp32
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Int8Conv2d.from_float(nn.Conv2d(16, 16, 3, padding=1), torch.tensor(3.0))
            self.b = Int8Conv2d.from_float(nn.Conv2d(16, 16, 1), torch.tensor(6.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return self.b(y) * 2 + y

    x = torch.randn(1, 16, 6, 6).contiguous(memory_format=CL)
    m = Two().eval()
    ep = torch.export.export(m, (x,))
    counts = fuse_lowp_convs(ep)
    assert counts["quantized_out"] == 0 and counts["inlined"] == 2
    torch.testing.assert_close(ep.module()(x), m(x))


def test_no_quantized_convs_is_a_no_op() -> None:
    m = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()).eval()
    ep = torch.export.export(m, (torch.randn(1, 4, 8, 8),))
    before = str(ep.graph)
    assert fuse_lowp_convs(ep) == {"folded": 0, "quantized_out": 0, "inlined": 0}
    assert str(ep.graph) == before


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_cnn_engine_runs_convolutions_in_low_precision_on_gpu(precision: str) -> None:
    """A two-bottleneck CNN as an int8/fp8 engine with every layer low precision (``layer_precision="all"``): its
    convolutions run as Triton conv2d_q kernels with folded epilogues and quantized hand-overs, within 8-bit
    tolerance of the fp32 model (cosine); the default build (layers timed) is also accurate and says what it kept."""
    from overdrive.engine import Builder, ShapeProfile

    torch.manual_seed(0)
    m = _randomize_bn(nn.Sequential(Bottleneck(c=64, down=True), Bottleneck(c=128))).eval()
    x = torch.randn(16, 64, 28, 28)
    with torch.no_grad():
        ref = m(x)
    prof = [ShapeProfile.fixed("x", (16, 64, 28, 28))]
    for layer_precision in ("all", "timed"):
        eng = Builder(precision=precision, device="cuda", profiles=prof, layer_precision=layer_precision).build(
            m, (x,), input_names=["x"], calib=[(x,)])
        meta = eng.header["backend_meta"]
        out = eng(x).float().cpu()
        cos = torch.nn.functional.cosine_similarity(out.flatten(1), ref.flatten(1)).min().item()
        assert cos > 0.99, (layer_precision, cos)
        if layer_precision == "all":
            assert meta["lowp_conv"] == {"folded": 8, "quantized_out": 4, "inlined": 4}
            if precision == "int8":
                assert meta["int8_ops"] == {"overdrive::conv2d_q": 8}


@pytest.mark.parametrize("margin,reverted", [(1e9, 0), (1e-9, 2)])
def test_layer_timing_takes_quantized_convolutions(margin: float, reverted: int) -> None:
    """The per-layer choice times Int8Conv2d / Fp8Conv2d against a float Conv2d with the dequantized weights and puts
    that twin in where the low-precision kernel loses (here forced by the margin); the twin computes the same
    convolution up to the activation rounding."""
    from overdrive.engine.layer_choice import keep_float_where_faster

    m = nn.Sequential(Int8Conv2d.from_float(nn.Conv2d(16, 16, 3, padding=1), torch.tensor(4.0)), nn.ReLU(),
                      Int8Conv2d.from_float(nn.Conv2d(16, 32, 1, stride=2), torch.tensor(4.0))).eval()
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=CL)
    with torch.no_grad():
        before = m(x)
    m, kept = keep_float_where_faster(m, (x,), torch.device("cpu"), torch.float32, margin=margin)
    assert len(kept) == reverted
    assert sum(type(c) is nn.Conv2d for c in m) == reverted
    if reverted:
        assert all("k3x3" in why or "k1x1" in why for why in kept.values())
        with torch.no_grad():
            after = m(x)
        assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0).item() > 0.999
