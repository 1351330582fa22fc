"""The conv (+BN) (+add) + ReLU pass (engine/conv_fusion.py): which patterns become one ``overdrive::conv2d_relu``
call, which stay as they are, and the result against the unfused module. Reference: the eager module in the same
precision (bf16 on CPU, where the op is the plain composition): within 3e-2 of the output's scale, the rounding
of bf16 weights with the BatchNorm folded in; the op itself is bit-equal to conv2d + add + relu."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive._utils.errors import UsageError
from overdrive.engine.conv_fusion import fuse_conv_relu

CL = torch.channels_last
OP = torch.ops.overdrive.conv2d_relu.default


class Bottleneck(nn.Module):
    """ResNet's bottleneck: conv-BN-ReLU twice, conv-BN, the residual added in place, ReLU; a strided
    projection shortcut when ``down`` (conv-BN with no ReLU after it, which stays as it is)."""

    def __init__(self, c: int = 8, down: bool = False) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, stride=2 if down else 1, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c3, self.b3 = nn.Conv2d(c, 2 * c, 1, bias=True), nn.BatchNorm2d(2 * c)
        self.short = nn.Sequential(nn.Conv2d(c, 2 * c, 1, stride=2 if down else 1, bias=False), nn.BatchNorm2d(2 * c))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.b1(self.c1(x)))
        y = self.act(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        y += self.short(x)
        return self.act(y)


def _randomize_bn(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    for bn in m.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=g) * 0.5)
            bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
            bn.weight.data.copy_(torch.randn(bn.num_features, generator=g))
            bn.bias.data.copy_(torch.randn(bn.num_features, generator=g) * 0.1)
    return m


def _model(dtype: torch.dtype = torch.bfloat16, down: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = _randomize_bn(Bottleneck(down=down)).eval().to(dtype)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _export(m: nn.Module, x: torch.Tensor, dynamic=None):
    with torch.no_grad():
        return torch.export.export(m, (x,), dynamic_shapes=dynamic, strict=False)


def _count(ep) -> int:
    return sum(n.target is OP for n in ep.graph.nodes)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 3e-2) -> bool:
    return (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()


def test_the_op_is_the_plain_composition_and_keeps_the_layout() -> None:
    torch.manual_seed(0)
    x, w, b, z = torch.randn(2, 4, 9, 9), torch.randn(6, 4, 3, 3), torch.randn(6), torch.randn(2, 6, 5, 5)
    y = OP(x, w, b, z, [2, 2], [1, 1], [1, 1], 1)
    assert torch.equal(y, F.relu(F.conv2d(x, w, b, 2, 1) + z))
    assert y.is_contiguous()
    y_cl = OP(x.contiguous(memory_format=CL), w, b, None, [1, 1], [1, 1], [1, 1], 1)
    assert y_cl.stride() == torch.empty(2, 6, 9, 9, memory_format=CL).stride()  # what the fake kernel promises
    from torch._subclasses import FakeTensorMode

    mode = FakeTensorMode()
    fx, fw, fb = (mode.from_tensor(t) for t in (x.contiguous(memory_format=CL), w, b))
    with mode:
        fake = OP(fx, fw, fb, None, [1, 1], [1, 1], [1, 1], 1)
    assert tuple(fake.shape) == tuple(y_cl.shape) and fake.stride() == y_cl.stride()


def test_one_channel_input_keeps_the_network_nhwc() -> None:
    """A one-channel image (or 1x1 spatial map) is NCHW and NHWC at once. The op reads it as NHWC, so its output and
    every fused convolution after it stay NHWC: read as NCHW, a grayscale ResNet-18 engine copied each later cuDNN
    output back to NCHW and ran 0.38x torch.compile on the H200 (engine_demo_variants_static.md). The fake kernel and
    the real one agree on the strides; the values are the plain composition's."""
    from torch._subclasses import FakeTensorMode

    from overdrive.engine.conv_fusion import _cudnn_operands

    torch.manual_seed(0)
    x, w, b = torch.randn(2, 1, 9, 9), torch.randn(6, 1, 3, 3), torch.randn(6)
    x_cl = x.contiguous(memory_format=CL)  # a no-op for one channel: the strides stay NCHW's
    assert x_cl.is_contiguous()
    want = torch.empty(2, 6, 9, 9, memory_format=CL).stride()
    y = OP(x_cl, w, b, None, [1, 1], [1, 1], [1, 1], 1)
    assert y.stride() == want
    assert torch.equal(y, F.relu(F.conv2d(x, w, b, 1, 1)))
    mode = FakeTensorMode()
    with mode:
        fake = OP(*(mode.from_tensor(t) for t in (x_cl, w, b)), None, [1, 1], [1, 1], [1, 1], 1)
    assert fake.stride() == want
    # what the CUDA kernel hands cuDNN: the input as an NHWC view of the same memory, the weight and residual
    # laid out as the input (an NHWC weight beside an NCHW input would make cuDNN answer NHWC)
    z = torch.randn(2, 6, 9, 9)
    xo, wo, zo = _cudnn_operands(x_cl, w, z)
    assert xo.stride() == (81, 1, 9, 1) and xo.data_ptr() == x_cl.data_ptr() and torch.equal(xo, x)
    assert wo.stride() == torch.empty(6, 1, 3, 3, memory_format=CL).stride() and torch.equal(wo, w)
    assert zo.stride() == want and torch.equal(zo, z)
    x4 = torch.randn(2, 4, 9, 9)  # plain NCHW: a channels_last weight (frozen so) goes back to NCHW
    xo, wo, _ = _cudnn_operands(x4, torch.randn(6, 4, 3, 3).contiguous(memory_format=CL), None)
    assert xo is x4 and wo.is_contiguous()


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_bottleneck_fuses_three_relus_and_keeps_the_projection(tmp_path: Path, layout: str) -> None:
    m = _model(down=True)
    x = torch.randn(2, 8, 12, 12).to(torch.bfloat16)
    x = x.contiguous(memory_format=CL) if layout == "channels_last" else x
    ep = _export(m, x)
    assert len(fuse_conv_relu(ep)) == 3  # conv1, conv2, conv3 + add; the shortcut's conv-BN has no ReLU
    targets = [n.target for n in ep.graph.nodes]
    assert targets.count(torch.ops.aten.conv2d.default) == 1  # the projection
    assert not any(t in (torch.ops.aten.relu_.default, torch.ops.aten.relu.default) for t in targets)
    path = tmp_path / "ep.pt2"
    torch.export.save(ep, path)  # the new nodes carry values, and the op is registered for loading
    with torch.no_grad():
        ref = m(x.clone())
        out = torch.export.load(path).module()(x.clone())
    assert _close(out, ref)
    assert out.is_contiguous(memory_format=CL) == (layout == "channels_last")


def test_dynamic_batch_and_compiled_with_freezing() -> None:
    m = _model()
    x = torch.randn(2, 8, 8, 8).to(torch.bfloat16).contiguous(memory_format=CL)
    ep = _export(m, x, ({0: torch.export.Dim("b", min=1, max=8)},))
    assert len(fuse_conv_relu(ep)) == 3
    fn = torch.compile(ep.module(), dynamic=True)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        for b in (2, 5):
            xb = torch.randn(b, 8, 8, 8).to(torch.bfloat16).contiguous(memory_format=CL)
            assert _close(fn(xb), m(xb.clone()))


class Unfusable(nn.Module):
    """Each branch breaks one condition of the pass."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y1 = self.c1(x)
        a = F.relu(y1)  # the conv's output is also returned: it must stay
        b = F.relu(self.c2(x) + bias)  # a broadcast add (bias is (4, 1, 1)): not the same-shape residual
        z = x * 2
        z += self.bn(self.c3(x))  # `z += conv(x)` writes z, which is read again below
        c = F.relu(z)
        return a, y1, b, c, z * 3


def test_patterns_that_must_stay() -> None:
    torch.manual_seed(0)
    m = _randomize_bn(Unfusable()).eval().to(torch.bfloat16)
    x, bias = torch.randn(2, 4, 6, 6).to(torch.bfloat16), torch.randn(4, 1, 1).to(torch.bfloat16)
    with torch.no_grad():
        ep = torch.export.export(m, (x, bias), strict=False)
        assert fuse_conv_relu(ep) == []
        outs, refs = ep.module()(x.clone(), bias), m(x.clone(), bias)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs))


def test_fp32_and_training_batchnorm_stay() -> None:
    x = torch.randn(2, 8, 8, 8)
    assert fuse_conv_relu(_export(_model(torch.float32), x)) == []  # fp32 engines keep IEEE convolutions
    m = _model()
    m.b1.train()  # normalizes by the batch's statistics: not foldable
    ep = _export(m, x.to(torch.bfloat16))
    assert len(fuse_conv_relu(ep)) == 2


def test_engine_option_and_defaults(tmp_path: Path) -> None:
    from overdrive.engine.backends.inductor import use_conv_fusion
    from overdrive.engine.config import BuildConfig

    assert use_conv_fusion(BuildConfig(), torch.device("cuda")) is True
    assert use_conv_fusion(BuildConfig(), torch.device("cpu")) is False
    assert use_conv_fusion(BuildConfig(conv_fusion=False), torch.device("cuda")) is False
    # a dynamic profile: off unless asked (measured 0.49x torch.compile with it, 0.92x without, on the H200)
    assert use_conv_fusion(BuildConfig(), torch.device("cuda"), dynamic=True) is False
    assert use_conv_fusion(BuildConfig(conv_fusion=True), torch.device("cuda"), dynamic=True) is True
    m = _model(torch.float32)
    x = torch.randn(2, 8, 8, 8)
    eng = Builder(precision="bf16", device="cpu", conv_fusion=True, profiles=[ShapeProfile.fixed("x", (2, 8, 8, 8))]
                  ).build(m, (x,), input_names=["x"])
    assert eng.info["backend"] == "inductor" and "--conv-fusion" in eng.info["backend_reason"]
    assert eng.header["backend_meta"]["conv_relu_fused"] == 3
    with torch.no_grad():
        ref = m(x.clone())
    assert _close(eng(x), ref)
    eng.save(tmp_path / "m.engine")
    assert _close(Engine.load(tmp_path / "m.engine")(x), ref)
    with pytest.raises(UsageError, match="--conv-fusion rewrites the PyTorch graph"):
        Builder(precision="fp32", device="cpu", backend="onnxruntime", conv_fusion=True).build(m, (x,), input_names=["x"])


def test_timed_choice_times_both_paths() -> None:
    """TimedChoice (the CUDA default) measured on CPU: a verdict per distinct shape, naming the ratio; a bug in the
    timing raises rather than passing for a refusal of the fused kernel."""
    from overdrive.engine.conv_fusion import TimedChoice

    timer = TimedChoice(torch.device("cpu"))
    ep = _export(_model(), torch.randn(2, 8, 8, 8).to(torch.bfloat16))
    fused = fuse_conv_relu(ep, timer)
    assert len(timer.verdicts) == 3
    assert all(v[1].split()[0] in ("fused", "unfused") and v[1].split()[1].endswith("x") for v in timer.verdicts.values())
    assert len(fused) == sum(v[0] for v in timer.verdicts.values())


@pytest.mark.gpu
def test_cuda_one_channel_stem_stays_nhwc_without_copies() -> None:
    """On CUDA the fused call answers NHWC for a one-channel input and an NHWC weight (as freezing leaves it) straight
    from cuDNN, and matches fp32 conv + ReLU within fp16 rounding (2e-3 of the output's scale)."""
    torch.manual_seed(0)
    x = torch.randn(8, 1, 32, 32, device="cuda").half().contiguous(memory_format=CL)
    w = torch.randn(16, 1, 7, 7, device="cuda").half().contiguous(memory_format=CL)
    b = torch.randn(16, device="cuda").half()
    y = OP(x, w, b, None, [2, 2], [3, 3], [1, 1], 1)
    assert y.stride() == torch.empty(8, 16, 16, 16, memory_format=CL).stride()
    conv = F.conv2d(x.float(), w.float(), b.float(), 2, 3)
    assert _close(y, F.relu(conv), 2e-3)
    z = torch.randn(8, 16, 16, 16, device="cuda").half()  # an NCHW residual beside an NHWC output: laid out to match
    y2 = OP(x, w, b, z, [2, 2], [3, 3], [1, 1], 1)
    assert _close(y2, F.relu(conv + z.float()), 2e-3)


class _GrayStem(nn.Module):
    """A network's first layers on one-channel images: conv 7x7 stride 2 + BN + ReLU, then a 3x3 conv."""

    def __init__(self, c_in: int = 1) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(c_in, 16, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(16)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.bn(self.stem(x))))


@pytest.mark.parametrize("c_in", [1, 3])
def test_stem_channels_padded_to_four_nhwc_give_the_same_result(c_in: int) -> None:
    """pad_stem_channels: the first convolution's input padded with zero channels to 4, NHWC, its weight with zero
    input channels: the conv + ReLU fusion still takes it, and the output matches the unpadded module (bf16 on CPU:
    within 3e-2 of the output's scale, the rounding of bf16 weights with BatchNorm folded in); the 16-channel conv
    is left alone."""
    from overdrive.engine.conv_fusion import STEM_CHANNELS, pad_stem_channels

    torch.manual_seed(0)
    m = _randomize_bn(_GrayStem(c_in)).eval().to(torch.bfloat16)
    x = torch.randn(2, c_in, 16, 16).to(torch.bfloat16).contiguous(memory_format=CL)
    ep = _export(m, x)
    assert len(pad_stem_channels(ep)) == 1
    convs = [n for n in ep.graph.nodes if n.target is torch.ops.aten.conv2d.default]
    stem_in = convs[0].args[0].meta["val"]
    assert stem_in.shape[1] == STEM_CHANNELS and stem_in.is_contiguous(memory_format=CL)
    assert convs[1].args[0].meta["val"].shape[1] == 16  # the second conv: 16 channels, as it was
    assert len(fuse_conv_relu(ep)) == 1
    with torch.no_grad():
        assert _close(ep.module()(x.clone()), m(x.clone()))
    assert pad_stem_channels(ep) == []  # run again: nothing left on fewer than 4 channels
    vetoed = _export(m, x)
    assert pad_stem_channels(vetoed, lambda *a: False) == []


@pytest.mark.gpu
def test_cuda_stem_pad_is_timed_and_exact() -> None:
    """On CUDA the pad is decided by timing (a verdict per shape), and the padded fp16 convolution equals the plain
    one to fp16 rounding (1e-3 of the output's scale): the added channels are zero on both sides."""
    from overdrive.engine.conv_fusion import STEM_CHANNELS, TimedStemPad, _pad_channels

    timer = TimedStemPad(torch.device("cuda"))
    x = torch.randn(64, 1, 112, 112, device="cuda").half().contiguous(memory_format=CL)
    w = torch.randn(32, 1, 7, 7, device="cuda").half()
    assert isinstance(timer(x, w, [2, 2], [3, 3], [1, 1]), bool)
    assert len(timer.verdicts) == 1 and next(iter(timer.verdicts.values()))[1].split()[0] in ("padded", "as")
    y = F.conv2d(x, w, None, 2, 3)
    yp = F.conv2d(_pad_channels(x, STEM_CHANNELS), _pad_channels(w, STEM_CHANNELS), None, 2, 3)
    assert _close(yp, y, 1e-3)


def test_cli_pads_a_grayscale_stem_and_prints_the_fusions(tmp_path: Path, digits: nn.Module, digits_onnx: bytes,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The engine's convolution passes (--conv-fusion) pad the digits CNN's one-channel first convolution to 4 NHWC
    channels and fuse its conv + ReLU pairs; overdrive build prints them on one line (as trtexec reports its
    fusions), and the saved engine, loaded, stays within bf16 rounding of the fp32 model."""
    import re

    from overdrive.cli.main import main

    path = tmp_path / "d.onnx"
    path.write_bytes(digits_onnx)
    assert main(["build", "--onnx", str(path), "--saveEngine", str(tmp_path / "d.engine"), "--shapes", "x:2x1x8x8",
                 "--device", "cpu", "--backend", "inductor", "--bf16", "--conv-fusion"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\[I\] fusions: conv\+ReLU \(cuDNN\) [1-9][0-9]*, stem padded to 4 channels 1\b", out), out
    eng = Engine.load(tmp_path / "d.engine")
    assert eng.header["backend_meta"]["stem_channels_padded"] == 1
    x = torch.rand(2, 1, 8, 8) * 16
    with torch.no_grad():
        assert _close(eng(x), digits.eval()(x), 5e-2)
