"""Real int8 / fp8 modules against the fake-quant model they come from; weight-only int8/int4."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError


def _mlp(k: int = 64, n: int = 128) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, n), nn.ReLU(), nn.Linear(n, 32))


def _calibrated(cfg, device="cpu", k: int = 64) -> tuple[nn.Module, torch.Tensor]:
    x = torch.randn(256, k, device=device)
    model = quant.quantize(_mlp(k).to(device), cfg, forward_loop=lambda m: m(x))
    return model, x


def test_int8_real_matches_fake_quant_cpu() -> None:
    """Integer GEMM = fake-quant float GEMM up to fp32 rounding of the int32 sum (atol 1e-5)."""
    model, x = _calibrated(quant.INT8_DEFAULT)
    with torch.no_grad():
        ref = model(x)
        real = quant.to_real(copy.deepcopy(model))
        out = real(x)
    assert isinstance(real[0], quant.Int8Linear) and real[0].w_q.dtype == torch.int8
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_int8_conv1x1_and_fallbacks_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Conv2d(16, 16, 1, stride=2), nn.Conv2d(16, 8, 3, padding=1))
    x = torch.randn(4, 8, 6, 6)
    q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    with torch.no_grad():
        ref = q(x)
        real = quant.to_real(copy.deepcopy(q))
        out = real(x)
    assert type(real[0]).__name__ == "Int8Conv1x1" and type(real[2]).__name__ == "Int8Conv1x1"
    assert type(real[3]) is nn.Conv2d and "no low-precision kernel" in real._overdrive_real["3"]
    # the 3x3 conv runs in float now, so compare with a tolerance of a few int8 steps
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()


def test_to_real_errors() -> None:
    with pytest.raises(UsageError, match="before calibration"):
        quant.to_real(quant.quantize(_mlp(), quant.INT8_DEFAULT))
    with pytest.raises(UsageError, match="no quantized layers"):
        quant.to_real(_mlp())
    if not torch.cuda.is_available():
        model, _ = _calibrated(quant.FP8_DEFAULT)
        with pytest.raises(UsageError, match="compute capability 8.9"):
            quant.to_real(model)


def test_weight_operand_needs_no_copy() -> None:
    """w_q is (N, K) contiguous, so w_q.t() is the column-major (K, N) operand cuBLAS takes without a copy."""
    model, _ = _calibrated(quant.INT8_DEFAULT)
    real = quant.to_real(model)
    w = real[0].w_q
    assert w.shape == (128, 64) and w.is_contiguous() and w.t().stride() == (1, 64)


class _Recorder:
    """A stand-in compiler: returns the eager function wrapped so calls can be counted."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, fn):  # noqa: ANN001, ANN204
        def compiled(*args):  # noqa: ANN002, ANN202
            self.calls.append(fn.__name__)
            if self.fail:
                raise RuntimeError("inductor exploded")
            return fn(*args)
        return compiled


def test_fused_steps_wiring_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantize + epilogue go through the compiled steps when allowed; a compile failure warns once
    and falls back to the eager steps with the same output."""
    from overdrive.quant import real as real_mod

    model, x = _calibrated(quant.INT8_DEFAULT)
    real = quant.to_real(model)
    with torch.no_grad():
        ref = real(x)  # CPU: eager steps
    assert not real_mod._can_compile(x)  # never compiled on CPU
    monkeypatch.setattr(real_mod, "_can_compile", lambda t: True)
    rec = _Recorder()
    monkeypatch.setattr(real_mod, "_FUSED", real_mod._FusedSteps(compiler=rec))
    with torch.no_grad():
        out = real(x)
    assert rec.calls == ["_quantize_int8", "_int8_epilogue"] * 2  # two Int8Linear layers
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    bad = _Recorder(fail=True)
    monkeypatch.setattr(real_mod, "_FUSED", real_mod._FusedSteps(compiler=bad))
    with pytest.warns(RuntimeWarning, match="torch.compile of the int8/fp8.*inductor exploded"):
        with torch.no_grad():
            out = real(x)
    assert real_mod._FUSED.failed and bad.calls == ["_quantize_int8"]  # tried once, then eager for good
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_quantize_steps_match_the_fake_quantizer() -> None:
    """The int8 / fp8 quantize steps give exactly the fake quantizer's grid values."""
    from overdrive.quant import QuantizerConfig, TensorQuantizer
    from overdrive.quant import real as real_mod

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    for fmt, fn in (("int8", real_mod._quantize_int8), ("fp8_e4m3", real_mod._quantize_fp8)):
        q = TensorQuantizer(QuantizerConfig(format=fmt))
        q.start_calibration()
        q(x)
        q.finish_calibration()
        s = q.scale()
        torch.testing.assert_close(fn(x, s).float() * s, q(x), rtol=0, atol=0)
    xq, xs = real_mod._quantize_fp8_rowwise(x)
    assert xs.shape == (64, 1)
    torch.testing.assert_close(xs, x.abs().amax(1, keepdim=True) / 448)
    assert float(xq.float().abs().amax()) == 448.0  # each row's largest value lands on the top of the grid


@pytest.mark.parametrize("bits, group, tol", [(8, 64, 0.01), (4, 32, 0.2)])
def test_weight_only(bits: int, group: int, tol: float) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 128)
    x = torch.randn(8, 256)
    q = quant.weight_only(nn.Sequential(lin, nn.ReLU()), bits=bits, group_size=group, min_features=64)
    assert isinstance(q[0], quant.WeightOnlyLinear)
    assert q[0].q.numel() == 128 * 256 // (2 if bits == 4 else 1)
    w = lin.weight.detach().view(128, -1, group)
    qmax = 127 if bits == 8 else 7
    s = w.abs().amax(-1, keepdim=True) / qmax
    ref_w = (torch.clamp(torch.round(w / s), -qmax - (bits == 4), qmax) * s).view(128, 256)
    torch.testing.assert_close(q[0].dequantized_weight(torch.float32), ref_w, rtol=0, atol=1e-6)
    err = (q[0](x) - lin(x)).abs().max() / lin(x).abs().max()
    assert err < tol
    with pytest.raises(UsageError, match="group_size"):
        quant.WeightOnlyLinear.from_linear(nn.Linear(100, 8), bits=4, group_size=64)


# --- GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_real_cuda(dtype: torch.dtype) -> None:
    model, x = _calibrated(quant.INT8_DEFAULT, "cuda", k=256)
    with torch.no_grad():
        ref = model(x)
        real = quant.to_real(copy.deepcopy(model))
        out = real(x.to(dtype)).float()
        small = real(x[:5].to(dtype)).float()  # M <= 16 is padded for _int_mm
    if dtype == torch.float32:
        # exact integer GEMMs: equal to fake quant up to fp32 rounding, except where that rounding (another
        # summation order than cuBLAS's fp32 GEMM) moves a hidden activation across a rounding boundary of the
        # next layer's input quantizer: one step there moves its row's outputs by at most step x max|W2|
        # (an H100 run had 1 row of 256 so, by 1.5e-3 with a bound of 1.6e-3)
        step = model[2].input_quantizer.amax.item() / 127
        bound = step * model[2].weight.abs().max().item()
        diff = (out - ref).abs()
        assert (diff > 1e-4).any(1).float().mean().item() <= 0.02  # rare rows
        assert diff.max().item() <= 2 * bound + 1e-4, (diff.max().item(), bound)
    else:  # bf16 input/output rounding: SQNR > 30 dB
        sqnr = 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean())
        assert sqnr > 30, float(sqnr)
    torch.testing.assert_close(small, out[:5], rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("rowwise", [False, True])
def test_fp8_real_cuda(rowwise: bool) -> None:
    from overdrive._utils.device import supports_fp8

    if not supports_fp8(torch.device("cuda")):
        pytest.skip("fp8 needs compute capability 8.9+")
    model, x = _calibrated(quant.FP8_DEFAULT, "cuda", k=256)
    with torch.no_grad():
        ref = model(x)
        real = quant.to_real(copy.deepcopy(model), rowwise=rowwise)
        out = real(x.bfloat16()).float()
    assert isinstance(real[0], quant.Fp8Linear) and real[0].w_q.dtype == torch.float8_e4m3fn
    # fp8 e4m3 has 3 mantissa bits; per-tensor weight scale and bf16 output: SQNR > 25 dB vs fake quant
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean())
    assert sqnr > 25, float(sqnr)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_dynamic_real_cuda(fmt: str) -> None:
    """Dynamic per-token int8 (torch._int_mm) / fp8 (_scaled_mm rowwise) on CUDA against the fake-quant model in
    fp32: bf16 activations in and out, SQNR > 30 dB (int8) / 25 dB (fp8: 3 mantissa bits)."""
    from overdrive._utils.device import supports_fp8

    if fmt == "fp8_e4m3" and not supports_fp8(torch.device("cuda")):
        pytest.skip("fp8 needs compute capability 8.9+")
    q = quant.QuantizerConfig(format=fmt, dynamic=True)
    cfg = quant.INT8_DYNAMIC.replace(input=q, weight=quant.INT8_DYNAMIC.weight.replace(format=fmt))
    model = quant.quantize(_mlp(256).cuda(), cfg)
    x = torch.randn(512, 256, device="cuda")
    x[::32] *= 50.0  # outlier tokens
    with torch.no_grad():
        ref = model(x)
        real = quant.to_real(copy.deepcopy(model))
        out = real(x.bfloat16()).float()
    assert type(real[0]).__name__ == ("Int8Linear" if fmt == "int8" else "Fp8Linear")
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean())
    assert sqnr > (30 if fmt == "int8" else 25), float(sqnr)


@pytest.mark.gpu
@pytest.mark.parametrize("rowwise", [False, True])
def test_fp8_real_takes_column_major_inputs_cuda(rowwise: bool) -> None:
    """A 1x1 conv at batch 1 on an NCHW-contiguous input reaches the GEMM as a column-major (H*W, C) view, and a
    Linear may get a transposed input: _scaled_mm needs a row-major operand (it raised "Only multiplication of
    row-major and column-major matrices" in fp8 engines of ResNet-50 and EfficientNet at batch 1). Reference: the
    same layer on a contiguous copy of the input, bit for bit."""
    from overdrive._utils.device import supports_fp8
    from overdrive.quant.real import Fp8Conv1x1

    if not supports_fp8(torch.device("cuda")):
        pytest.skip("fp8 needs compute capability 8.9+")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(64, 128, generator=g), torch.randn(64, generator=g)
    x_amax = torch.tensor(4.0)
    conv = Fp8Conv1x1(w.cuda(), w.abs().amax(1).cuda(), x_amax.cuda(), b.cuda(), rowwise=rowwise)
    x = torch.randn(1, 128, 7, 7, generator=g).cuda().bfloat16()  # NCHW contiguous, batch 1
    assert x.permute(0, 2, 3, 1).reshape(-1, 128).stride() == (1, 49)  # the column-major view the GEMM sees
    out = conv(x)
    ref = conv(x.contiguous(memory_format=torch.channels_last))
    assert out.shape == (1, 64, 7, 7) and torch.equal(out, ref)
    lin = quant.Fp8Linear(w.cuda(), w.abs().amax(1).cuda(), x_amax.cuda(), b.cuda(), rowwise=rowwise)
    xt = torch.randn(128, 32, generator=g).cuda().bfloat16().t()  # (32, 128), column-major
    assert torch.equal(lin(xt), lin(xt.contiguous()))


@pytest.mark.gpu
def test_fused_steps_compile_and_match_eager_cuda() -> None:
    """On CUDA the quantize / epilogue steps run compiled (no fallback) and give the eager values:
    the quantized activations bit for bit (IEEE division), the rescaled output to fp32 rounding."""
    from overdrive.quant import real as real_mod

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 256, device="cuda", generator=g).bfloat16()
    s = torch.tensor(4.0 / 127, device="cuda")
    fused = real_mod._FusedSteps()
    assert torch.equal(fused(real_mod._quantize_int8, x, s), real_mod._quantize_int8(x, s))
    assert torch.equal(fused(real_mod._quantize_fp8, x, s).float(), real_mod._quantize_fp8(x, s).float())
    q, qs = fused(real_mod._quantize_fp8_rowwise, x)
    eq, es = real_mod._quantize_fp8_rowwise(x)
    torch.testing.assert_close(qs, es, rtol=1e-6, atol=0)
    assert (q.float() != eq.float()).float().mean() < 1e-3  # /448.0 may become *(1/448): rare 1-step moves
    acc = torch.randint(-20000, 20000, (300, 128), device="cuda", dtype=torch.int32, generator=g)
    ws, b = torch.rand(128, device="cuda", generator=g) * 1e-3, torch.randn(128, device="cuda", generator=g)
    for bias, dt in ((b, torch.bfloat16), (None, torch.float32)):
        torch.testing.assert_close(fused(real_mod._int8_epilogue, acc, s, ws, bias, dt),
                                   real_mod._int8_epilogue(acc, s, ws, bias, dt))
    assert not fused.failed and len(fused.compiled) == 5  # the epilogue with and without bias: two variants


@pytest.mark.parametrize("cfg", [
    quant.INT8_DEFAULT.replace(input=quant.QuantizerConfig(narrow_range=True)),
    quant.INT8_DEFAULT.replace(weight=quant.QuantizerConfig(per_channel=True, narrow_range=False)),
], ids=["narrow-input", "wide-weight"])
def test_int8_real_keeps_the_quantizers_ranges(cfg) -> None:
    """The int8 module uses each quantizer's own range: a narrow-range input quantizer clamps at -127
    (inputs beyond -amax), a full-range weight quantizer at -128 (weights QAT moved past -amax).
    Before, Int8Linear always used [-128, 127] for x and [-127, 127] for w (off by one level)."""
    model, x = _calibrated(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.mul_(1.5)  # as after QAT at a large learning rate: past the frozen weight amax
        x = x * 3  # past the calibrated input amax
        ref = model(x)
        out = quant.to_real(copy.deepcopy(model))(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["max", "percentile", "entropy", "mse"])
def test_calibrated_amax_lives_on_the_models_cuda_device(method: str) -> None:
    """Histogram calibrators count on the CPU; the amax they give must land on the data's CUDA device (a CPU
    amax cost a copy per forward and broke CUDA-graph capture)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).cuda()
    x = torch.randn(16, 32, device="cuda")
    cfg = quant.INT8_DEFAULT.replace(method=method)
    quant.quantize(model, cfg, lambda m: m(x))
    devices = {q.amax.device.type for _, q in quant.quantizers(model) if q.amax is not None}
    assert devices == {"cuda"}


class _Residual(nn.Module):
    """Two layers and a residual add, in either operand order (``quant.quantize`` puts a QuantAdd on it)."""

    def __init__(self, residual_first: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.residual_first = residual_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(x + y if self.residual_first else y + x)


@pytest.mark.parametrize("cfg,fmt", [(quant.INT8_DEFAULT, "int8"), (quant.FP8_DEFAULT, "fp8")])
@pytest.mark.parametrize("residual_first", [False, True])
def test_to_real_quantizes_residual_adds_as_the_fake_quantizer_does(cfg, fmt: str, residual_first: bool) -> None:
    """A calibrated QuantAdd becomes QuantizedResidualAdd: overdrive::quantize + overdrive::dequantize of the residual
    by the calibrated scale (fp32), the same values as the fake quantization (reference: the QuantAdd itself; tolerance:
    one 8-bit step where x / s and x * (1 / s) round apart, which a random input does not hit here)."""
    torch.manual_seed(0)
    x = torch.randn(64, 16) * 3
    fq = quant.quantize(_Residual(residual_first), cfg, forward_loop=lambda m: m(x))
    add = fq.residual_add0
    assert isinstance(add, quant.QuantAdd)
    with torch.no_grad():
        want = add(fq.a(x), x) if not residual_first else add(x, fq.a(x))
        real_add = quant.real._real_residual_add(add)
        got = real_add(fq.a(x), x) if not residual_first else real_add(x, fq.a(x))
    assert real_add.fmt == fmt and real_add.scale.dtype == torch.float32 and real_add.residual_first == residual_first
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if cfg is quant.INT8_DEFAULT:  # fp8 to_real of the Linear layers needs a CUDA GPU; the add alone is tested above
        real = quant.to_real(copy.deepcopy(fq))
        assert isinstance(real.residual_add0, quant.QuantizedResidualAdd)
        with torch.no_grad():
            torch.testing.assert_close(real(x), fq(x), rtol=1e-4, atol=1e-4)
        targets = {n.target for n in torch.export.export(real, (x,)).graph.nodes if n.op == "call_function"}
        assert {torch.ops.overdrive.quantize.default, torch.ops.overdrive.dequantize.default} <= targets


def test_to_real_keeps_a_disabled_residual_quantizer_fake() -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    fq = quant.quantize(_Residual(False), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    fq.residual_add0.residual_quantizer.enabled = False
    real = quant.to_real(fq)
    assert isinstance(real.residual_add0, quant.QuantAdd)
    assert quant.QuantizedResidualAdd(torch.tensor(1.0))(2, 3) == 5  # numbers are added as numbers


def test_quantized_residual_add_errors() -> None:
    with pytest.raises(UsageError, match=r"fmt='int4' must be 'int8' or 'fp8'"):
        quant.QuantizedResidualAdd(torch.tensor(1.0), fmt="int4")


def test_fused_steps_compile_every_variant_past_dynamos_recompile_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variant of a step (int8 / fp8, qmin, dtype) is compiled, however many there are: Dynamo's recompile limit
    counts per code object, and a build that met more variants than the limit ran the rest eagerly (several passes
    that the layer timing charged to the low-precision kernel). Reference: Dynamo's count of compiled frames."""
    from torch._dynamo.utils import counters

    from overdrive.quant import real as real_mod
    from overdrive.quant.conv import _quantize_ref

    monkeypatch.setattr(real_mod, "_can_compile", lambda t: True)
    torch._dynamo.reset()
    fused = real_mod._FusedSteps(compiler=lambda f: torch.compile(f, backend="eager", dynamic=True))
    x, s = torch.randn(4, 8), torch.tensor(0.05)
    before = counters["frames"]["ok"]
    with torch._dynamo.config.patch(recompile_limit=2):
        outs = [(fused(_quantize_ref, x.to(dt), s, qmin, fp8), _quantize_ref(x.to(dt), s, qmin, fp8))
                for dt in (torch.float32, torch.float16) for qmin, fp8 in ((-128, False), (-127, False), (-128, True))]
    assert counters["frames"]["ok"] - before == 6 and len(fused.compiled) == 6
    assert all(torch.equal(a.float(), b.float()) for a, b in outs)
