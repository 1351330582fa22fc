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
    """``m`` with every Conv2d replaced by ``cls`` calibrated on ``x`` (max calibration of each conv's input); grouped
    ones (depthwise: no int8/fp8 kernel) stay float, as ``to_real`` leaves them."""
    m = copy.deepcopy(m)
    amax: dict[str, torch.Tensor] = {}
    hooks = [c.register_forward_pre_hook(lambda mod, a, n=n: amax.__setitem__(n, a[0].abs().amax()))
             for n, c in m.named_modules() if isinstance(c, nn.Conv2d)]
    with torch.no_grad():
        m(x)
    for h in hooks:
        h.remove()
    for n, c in list(m.named_modules()):
        if isinstance(c, nn.Conv2d) and c.groups == 1:
            parent, _, leaf = n.rpartition(".")
            setattr(m.get_submodule(parent) if parent else m, leaf, cls.from_float(c, amax[n]))
    return m


def _fused(q: nn.Module, x: torch.Tensor, **kw) -> tuple[torch.export.ExportedProgram, dict[str, int], torch.Tensor]:
    """``q`` exported and fused in place: (its program, the pass's counts, its output on ``x``)."""
    with torch.no_grad():
        ep = torch.export.export(q, (x,))
        counts = fuse_lowp_convs(ep, **kw)
        return ep, counts, ep.module()(x)


def _assert_close_up_to_8_bit_flips(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same arithmetic in another order (BatchNorm folded into the scale): equal to fp32 rounding, except where a
    value at an 8-bit rounding boundary flips one step."""
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() > 0.9999
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


@pytest.mark.parametrize("cls", [Int8Conv2d, Fp8Conv2d])
def test_bottlenecks_fold_and_quantize_outputs_same_function(cls) -> None:
    torch.manual_seed(0)
    m = _randomize_bn(nn.Sequential(Bottleneck(c=16, down=True), Bottleneck(c=32))).eval()
    x = torch.randn(2, 16, 12, 12).contiguous(memory_format=CL)
    q = _quantized(m, cls, x).eval()
    with torch.no_grad():
        want = q(x)
    ep, counts, got = _fused(q, x)
    # 4 convs per block, each with its BatchNorm; c1 -> c2 -> c3 hand over quantized tensors, and so does the first
    # block's output (read by the second block's c1 and shortcut, calibrated on the same tensor: equal scales); the
    # model input (read by c1 and the shortcut) is quantized once, by inlined ATen ops
    assert counts == {"folded": 8, "quantized_out": 5, "dual_out": 0, "inlined": 1, "quantized_residuals": 0}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.overdrive.quantize.default not in targets
    assert not any(t in (torch.ops.aten.relu.default, torch.ops.aten.relu_.default, torch.ops.aten.add_.Tensor)
                   for t in targets)
    _assert_close_up_to_8_bit_flips(got, want)  # the reference: the unfused quantized modules


class _Two(nn.Module):
    """A conv whose output is read by a second conv (quantized) and by an add (float)."""

    def __init__(self, amax_b: float = 6.0, amax_c: float | None = None) -> None:
        super().__init__()
        self.a = Int8Conv2d.from_float(nn.Conv2d(16, 16, 3, padding=1), torch.tensor(3.0))
        self.b = Int8Conv2d.from_float(nn.Conv2d(16, 16, 1), torch.tensor(amax_b))
        self.c = None if amax_c is None else Int8Conv2d.from_float(nn.Conv2d(16, 16, 1), torch.tensor(amax_c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        z = self.b(y) * 2 + y
        return z if self.c is None else z + self.c(y)


def test_a_conv_read_in_float_and_quantized_writes_both() -> None:
    # the first conv's output is quantized for the second and also read by the add: one dual-output kernel writes
    # the float tensor and the quantized one; the model input's quantize is inlined
    torch.manual_seed(0)
    x = torch.randn(1, 16, 6, 6).contiguous(memory_format=CL)
    m = _Two().eval()
    ep = torch.export.export(m, (x,))
    counts = fuse_lowp_convs(ep)
    assert counts == {"folded": 0, "quantized_out": 0, "dual_out": 1, "inlined": 1, "quantized_residuals": 0}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.overdrive.conv2d_q_dual.default in targets
    torch.testing.assert_close(ep.module()(x), m(x))  # the reference: the unfused modules, same fp32 arithmetic


def test_quantizes_with_different_scales_are_not_merged() -> None:
    # two convs read one tensor with different calibrated scales: the dual output serves one, the other stays a
    # quantize of the float tensor (inlined), and the function is unchanged
    torch.manual_seed(0)
    x = torch.randn(1, 16, 6, 6).contiguous(memory_format=CL)
    m = _Two(amax_b=6.0, amax_c=2.0).eval()
    ep = torch.export.export(m, (x,))
    counts = fuse_lowp_convs(ep)
    # c folds the last add
    assert counts == {"folded": 1, "quantized_out": 0, "dual_out": 1, "inlined": 2, "quantized_residuals": 0}
    torch.testing.assert_close(ep.module()(x), m(x))


class _IdentityBlock(nn.Module):
    """A bottleneck with an identity shortcut: its input is read by c1 (quantized) and by the residual add (float).
    With ``q_res`` the residual is quantized by c1's input scale first (the reference for quantized residuals)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c3, self.b3 = nn.Conv2d(c, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c)
        self.q_res = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        r = x
        if self.q_res:
            c1 = self.c1
            r = torch.ops.overdrive.quantize(x, c1.x_scale, c1.x_qmin, c1.fmt == "fp8").float() * c1.x_scale
        return torch.relu(self.b3(self.c3(y)) + r)


def _resnet_blocks(identity: int = 2, batch: int = 2) -> tuple[nn.Module, torch.Tensor]:
    """A projection bottleneck and ``identity`` identity bottlenecks at 16 channels (BatchNorm statistics
    randomized, seed 0), and a channels_last input of ``batch`` 16x12x12 images."""
    torch.manual_seed(0)
    m = nn.Sequential(Bottleneck(c=16, down=True), *[_IdentityBlock(16) for _ in range(identity)])
    return _randomize_bn(m).eval(), torch.randn(batch, 16, 12, 12).contiguous(memory_format=CL)


@pytest.mark.parametrize("cls", [Int8Conv2d, Fp8Conv2d])
def test_identity_blocks_hand_over_dual_outputs(cls) -> None:
    m, x = _resnet_blocks()
    q = _quantized(m, cls, x).eval()
    with torch.no_grad():
        want = q(x)
    ep, counts, got = _fused(q, x)
    # the first and second blocks' outputs are both residuals and the next block's input: dual outputs; inside
    # each block c1 -> c2 -> c3 hand over quantized tensors; the model input is quantized once
    assert counts == {"folded": 10, "quantized_out": 6, "dual_out": 2, "inlined": 1, "quantized_residuals": 0}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.overdrive.quantize.default not in targets
    _assert_close_up_to_8_bit_flips(got, want)  # the reference: the unfused quantized modules


def test_no_quantized_convs_is_a_no_op() -> None:
    m = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()).eval()
    ep = torch.export.export(m, (torch.randn(1, 4, 8, 8),))
    before = str(ep.graph)
    assert fuse_lowp_convs(ep) == {"folded": 0, "quantized_out": 0, "dual_out": 0, "inlined": 0,
                                   "quantized_residuals": 0}
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
        if layer_precision == "timed":  # timed whole against its float twin (static CUDA profile): the faster kept
            whole = meta.get("whole_engine")  # absent only when the per-layer timing left no layer low precision
            assert whole is not None or (meta["lowp_layers"] == 0 and meta.get("float_build")), meta
            if whole is not None:
                assert "lowp_ms" in whole and whole["kept"] in (precision, "float16"), whole  # timed, not skipped
                from overdrive.engine.backends.whole_engine import WHOLE_ENGINE_MARGIN

                assert (whole["kept"] == "float16") == (whole["float_ms"] < whole["lowp_ms"] * WHOLE_ENGINE_MARGIN), whole
                assert (meta["lowp_layers"] == 0) == (whole["kept"] == "float16"), (whole, meta["lowp_layers"])
        if layer_precision == "all":
            assert "whole_engine" not in meta
            assert meta["lowp_conv"] == {"folded": 8, "quantized_out": 7, "dual_out": 0, "inlined": 1,
                                         "quantized_residuals": 2}  # both shortcuts are quantized residuals
            if precision == "int8":
                assert meta["int8_ops"] == {"overdrive::conv2d_q": 8}


@pytest.mark.parametrize("cls", [Int8Conv2d, Fp8Conv2d])
def test_quantized_residuals_hand_over_only_8_bit_tensors(cls) -> None:
    # with quantize_residuals, the identity blocks' residual adds read the block input's 8-bit tensor (c1's input):
    # the block outputs have no float reader left and are written 8-bit only; the reference is the unfused model
    # with each residual quantized by c1's scale
    m, x = _resnet_blocks()
    q = _quantized(m, cls, x).eval()
    with torch.no_grad():
        plain = q(x)
        for blk in list(q)[1:]:
            blk.q_res = True
        want = q(x)
        for blk in list(q)[1:]:
            blk.q_res = False
    ep, counts, got = _fused(q, x, quantize_residuals=True)
    assert counts == {"folded": 10, "quantized_out": 8, "dual_out": 0, "inlined": 1, "quantized_residuals": 2}
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.overdrive.conv2d_q_dual.default not in targets
    _assert_close_up_to_8_bit_flips(got, want)
    # against the float residuals: only the 8-bit rounding of the two residuals apart
    assert torch.nn.functional.cosine_similarity(got.flatten(), plain.flatten(), dim=0).item() > 0.999


def test_quantized_residuals_counted_with_and_without_the_option() -> None:
    m = nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()).eval()
    ep = torch.export.export(m, (torch.randn(1, 4, 8, 8),))
    assert fuse_lowp_convs(ep)["quantized_residuals"] == 0
    assert fuse_lowp_convs(ep, quantize_residuals=True)["quantized_residuals"] == 0


def test_quantize_residuals_is_for_int8_and_fp8_builds(tmp_path) -> None:
    # a float build with the flag: one clear error (config and CLI) before any work; an int8 config keeps it, and
    # the engine header's config leaves it out at its default (older engine files read the same)
    import contextlib
    import io

    from overdrive._utils.errors import UsageError
    from overdrive.cli.main import main
    from overdrive.engine.config import BuildConfig

    with pytest.raises(UsageError, match=r"quantize_residuals \(--quantize-residuals\) applies to int8 / fp8"):
        BuildConfig(precision="fp16", quantize_residuals=True)
    cfg = BuildConfig(precision="int8", quantize_residuals=True)
    assert BuildConfig.from_json(cfg.to_json()) == cfg
    assert "quantize_residuals" not in BuildConfig(precision="int8").to_json()
    model_py = tmp_path / "m.py"
    model_py.write_text("import torch\ndef build():\n    return torch.nn.Conv2d(16, 16, 3)\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["build", "--model", f"{model_py}:build", "--shapes", "x:1x16x8x8", "--fp16",
                     "--quantize-residuals", "--save-engine", str(tmp_path / "m.engine")])
    assert code != 0 and "--quantize-residuals" in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1
    assert not (tmp_path / "m.engine").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantized_residual_engine_on_gpu(precision: str) -> None:
    """An int8/fp8 engine of ResNet blocks: the residual adds the calibration quantizes (quant's residual-add
    quantizers) read the 8-bit tensors in the Triton kernel's epilogue, the projection shortcut and both identity
    blocks (no dual outputs, no float block outputs left), within 8-bit tolerance of the fp32 model (cosine)."""
    from overdrive.engine import Builder, ShapeProfile

    torch.manual_seed(0)
    m = _randomize_bn(nn.Sequential(Bottleneck(c=64, down=True), _IdentityBlock(64), _IdentityBlock(64))).eval()
    x = torch.randn(16, 64, 28, 28)
    with torch.no_grad():
        ref = m(x)
    eng = Builder(precision=precision, device="cuda", profiles=[ShapeProfile.fixed("x", (16, 64, 28, 28))],
                  layer_precision="all").build(m, (x,), input_names=["x"], calib=[(x,)])
    lowp = eng.header["backend_meta"]["lowp_conv"]
    assert lowp["quantized_residuals"] == 3 and lowp["dual_out"] == 0, lowp
    out = eng(x).float().cpu()
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), ref.flatten(1)).min().item()
    assert cos > 0.99, cos


def _calibrated_real(m: nn.Module, fmt: str, x: torch.Tensor) -> nn.Module:
    """``m`` calibrated as an engine calibrates it (``quant.quantize``, residual-add quantizers included) and converted
    as ``quant.to_real`` converts it on CUDA: every QuantConv2d an Int8Conv2d / Fp8Conv2d, every QuantAdd a
    QuantizedResidualAdd (the CPU's to_real would leave 3x3 convolutions float)."""
    from overdrive import quant
    from overdrive.quant.real import _real_residual_add, _set

    cfg = quant.INT8_DEFAULT if fmt == "int8" else quant.FP8_DEFAULT
    cls = Int8Conv2d if fmt == "int8" else Fp8Conv2d
    q = quant.quantize(copy.deepcopy(m), cfg, lambda mm: mm(x), fidelity=False)
    for n, c in list(q.named_modules()):
        if isinstance(c, quant.QuantConv2d):
            _set(q, n, cls(c.weight, c.weight_quantizer.amax, c.input_quantizer.amax, c.bias, c.stride, c.padding,
                           c.dilation, x_qmin=-127 if c.input_quantizer.config.narrow_range else -128))
        elif isinstance(c, quant.QuantAdd):
            _set(q, n, _real_residual_add(c))
    return q.eval()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_residuals_the_model_quantizes_are_read_8_bit(fmt: str) -> None:
    """Residual adds calibrated with quantizers (QuantizedResidualAdd: quantize + dequantize of the residual) are
    folded with the 8-bit tensor as the residual and its scale as res_scale, with or without ``quantize_residuals``:
    the projection shortcut and both identity blocks; every block hands over 8-bit tensors only (no dual output, no
    dequantize left). The residual scales equal the next convolution's input scales (both calibrated on the block
    output), so each block output is quantized once. Reference: the unfused model (same arithmetic)."""
    m, x = _resnet_blocks(batch=4)
    q = _calibrated_real(m, fmt, x)
    with torch.no_grad():
        want = q(x)
    for qres in (False, True):
        ep, counts, got = _fused(q, x, quantize_residuals=qres)
        assert counts == {"folded": 10, "quantized_out": 9, "dual_out": 0, "inlined": 1, "quantized_residuals": 3}
        targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        assert torch.ops.overdrive.dequantize.default not in targets
        assert torch.ops.overdrive.conv2d_q_dual.default not in targets
        _assert_close_up_to_8_bit_flips(got, want)
    from overdrive.engine.lowp_conv_fusion import conv_epilogues

    ep, _, _ = _fused(q, x)  # what the per-layer timing times: these three with their 8-bit residual
    assert {k: v["residual"] for k, v in conv_epilogues(ep).items() if v["residual"]} == {
        "0.c3": "8-bit", "1.c3": "8-bit", "2.c3": "8-bit"}
    # an fp16 remainder (the CUDA engine's) keeps the residual scales fp32, as the convolutions' scales
    from overdrive.engine.backends.prepare import cast_float_remainder

    half = cast_float_remainder(copy.deepcopy(q), torch.float16)
    assert half[1].residual_add0.scale.dtype == torch.float32 and half[1].b1.weight.dtype == torch.float16


def test_a_dequantize_not_read_by_a_convolution_is_inlined() -> None:
    # a residual add after a non-convolution (here an input + a pooling) keeps its quantize-dequantize as ATen ops,
    # which Inductor fuses into the add
    from overdrive.quant import QuantizedResidualAdd

    class PoolAdd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add = QuantizedResidualAdd(torch.tensor(3.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.add(torch.nn.functional.avg_pool2d(x, 1), x)

    m = PoolAdd()
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        want = m(x)
        ep = torch.export.export(m, (x,))
        counts = fuse_lowp_convs(ep)
        got = ep.module()(x)
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert counts["inlined"] == 1 and counts["quantized_residuals"] == 0
    assert not targets & {torch.ops.overdrive.quantize.default, torch.ops.overdrive.dequantize.default}
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


class _MBConv(nn.Module):
    """An EfficientNet-style block: 1x1 expand + BN + activation, depthwise 3x3 (groups: stays float) + BN +
    activation, 1x1 project + BN, residual add (no activation after it)."""

    def __init__(self, c: int, act: nn.Module) -> None:
        super().__init__()
        self.expand, self.b1, self.a1 = nn.Conv2d(c, 4 * c, 1, bias=False), nn.BatchNorm2d(4 * c), act
        self.dw, self.b2 = nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=4 * c, bias=False), nn.BatchNorm2d(4 * c)
        self.a2 = copy.deepcopy(act)
        self.project, self.b3 = nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a1(self.b1(self.expand(x)))
        y = self.a2(self.b2(self.dw(y)))
        return self.b3(self.project(y)) + x


@pytest.mark.parametrize("act,code", [(nn.SiLU(inplace=True), "silu"), (nn.GELU(), "gelu"), (nn.SiLU(), "silu")])
@pytest.mark.parametrize("cls", [Int8Conv2d, Fp8Conv2d])
def test_silu_and_gelu_fold_into_the_epilogue(act: nn.Module, code: str, cls) -> None:
    """SiLU (in place or not) and GELU after a convolution's BatchNorm go into its epilogue (act), as ReLU does; the
    projection folds BatchNorm and the residual; the program computes what the unfused modules compute; the plan
    the layer timing reads names the activation."""
    from overdrive.engine.lowp_conv_fusion import conv_epilogues

    torch.manual_seed(0)
    m = _randomize_bn(nn.Sequential(_MBConv(16, act), _MBConv(16, copy.deepcopy(act)))).eval()
    x = torch.randn(2, 16, 10, 10).contiguous(memory_format=CL)
    q = _quantized(m, cls, x).eval()  # the depthwise convolutions stay float
    with torch.no_grad():
        want = q(x)
    ep, counts, got = _fused(q, x)
    assert counts["folded"] == 4, counts
    acts = [n.args[14] for n in ep.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.overdrive.conv2d_q.default,) and len(n.args) > 14]
    assert acts.count({"silu": 1, "gelu": 2}[code]) == 2, acts
    plan = conv_epilogues(ep)
    assert plan["0.expand"]["act"] == code and not plan["0.expand"]["relu"]
    assert "act" not in plan["0.project"] and plan["0.project"]["residual"] == "float"
    _assert_close_up_to_8_bit_flips(got, want)


def test_tanh_gelu_and_relu_with_an_act_are_not_folded_or_refused() -> None:
    # GELU's tanh form is another function (left to Inductor); conv2d_q refuses relu together with an act
    from overdrive._utils.errors import UsageError

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(16, 32, 1), nn.GELU(approximate="tanh")).eval()
    x = torch.randn(2, 16, 6, 6).contiguous(memory_format=CL)
    q = _quantized(m, Int8Conv2d, x).eval()
    with torch.no_grad():
        want = q(x)
    ep, counts, got = _fused(q, x)
    assert counts["folded"] == 0
    torch.testing.assert_close(got, want)
    c = q[0]
    xq = torch.ops.overdrive.quantize(x, c.x_scale, -128, False)
    with pytest.raises(UsageError, match=r"act=1 with relu=True: act is 0 \(none\), 1 \(SiLU\) or 2 \(GELU\)"):
        torch.ops.overdrive.conv2d_q(xq, c.w_q, c.scale, c.bias, None, True, None, torch.float32, -128, [1, 1],
                                     [0, 0], [1, 1], -1, None, 1)


@pytest.mark.parametrize("cls", [Int8Conv2d, Fp8Conv2d])
def test_precompile_runs_each_distinct_fused_convolution_once(cls) -> None:
    """Before an int8/fp8 engine compiles, every distinct conv2d_q / conv2d_q_dual call of its fused program runs once
    on zeros of its arguments' shapes, strides and dtypes (on the GPU: its Triton kernel compiles then, side by side).
    Reference: the program's own nodes; on CPU each call runs the op's fp32 reference and must give the node's output
    shape and dtype."""
    from overdrive.engine.lowp_conv_fusion import precompile_convs

    torch.manual_seed(0)
    m = _randomize_bn(nn.Sequential(Bottleneck(c=16, down=True), Bottleneck(c=32))).eval()
    x = torch.randn(2, 16, 12, 12).contiguous(memory_format=CL)
    ep, _, _ = _fused(_quantized(m, cls, x).eval(), x)
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.overdrive.conv2d_q.default, torch.ops.overdrive.conv2d_q_dual.default)]
    ran: list = []

    def run(calls, device):  # noqa: ANN001, ANN202 - compile_in_threads' part, run here one by one
        assert device == torch.device("cpu")
        ran.extend(fn() for fn in calls)

    n = precompile_convs(ep, torch.device("cpu"), run=run)
    assert n == len(ran) == len(nodes)  # every convolution of these blocks has its own shapes
    outs = {(tuple(o.shape), o.dtype) for r in ran for o in (r if isinstance(r, tuple) else (r,))}
    want = {(tuple(v.shape), v.dtype) for nd in nodes
            for v in (nd.meta["val"] if isinstance(nd.meta["val"], tuple) else (nd.meta["val"],))}
    assert outs == want

    # three equal 3x3 layers: the first two read and write 8-bit tensors of one shape (one call covers both), the last
    # writes float
    chain = nn.Sequential(*[mod for _ in range(3) for mod in (nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())]).eval()
    ep, _, _ = _fused(_quantized(chain, cls, x).eval(), x)
    ran.clear()
    assert precompile_convs(ep, torch.device("cpu"), run=run) == len(ran) == 2
