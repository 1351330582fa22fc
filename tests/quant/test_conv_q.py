"""Real int8 / fp8 convolutions (quant/conv.py): the op's fp32 reference against float convolutions, the modules,
export, bad input, and the tile choices (CPU). The Triton kernel itself: test_conv_q_gpu.py (compiled for Hopper and
run on a GPU) and test_conv_q_interpreter.py (on the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.quant.conv import FP8, Fp8Conv2d, Int8Conv2d, conv2d_q, conv2d_q_dual, quantize, unsupported

CL = torch.channels_last


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize("cls,min_cos", [(Int8Conv2d, 0.9995), (Fp8Conv2d, 0.998)])
@pytest.mark.parametrize("k,stride,pad,dil", [(3, 1, 1, 1), (3, 2, 1, 1), (1, 2, 0, 1), (5, 1, 2, 1), (3, 1, 2, 2)])
def test_module_matches_float_conv(cls, min_cos, k, stride, pad, dil) -> None:
    # reference: the float convolution; tolerance: the rounding of 8-bit activations and weights (cosine)
    conv = torch.nn.Conv2d(32, 24, k, stride=stride, padding=pad, dilation=dil)
    x = torch.randn(2, 32, 11, 9).contiguous(memory_format=CL)
    q = cls.from_float(conv, x.abs().amax())
    y, ref = q(x), conv(x)
    assert y.shape == ref.shape and y.is_contiguous(memory_format=CL)
    assert _cos(y, ref) > min_cos


def test_reference_epilogue_and_quantized_output() -> None:
    # the op's epilogue against the same steps written out: scale, bias, residual, ReLU, the next quantize
    x = torch.randint(-100, 100, (2, 16, 6, 6), dtype=torch.int8).contiguous(memory_format=CL)
    w = torch.randint(-100, 100, (8, 16, 3, 3), dtype=torch.int8).contiguous(memory_format=CL)
    scale, bias = torch.rand(8) * 1e-3, torch.randn(8)
    res = torch.randn(2, 8, 6, 6)
    want = torch.relu(F.conv2d(x.double(), w.double(), None, 1, 1) * scale.double().view(1, -1, 1, 1)
                      + bias.double().view(1, -1, 1, 1) + res.double())
    got = conv2d_q(x, w, scale, bias, res, True, None, torch.float32, -128, [1, 1], [1, 1], [1, 1], -1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    s = torch.tensor(0.02)
    q8 = conv2d_q(x, w, scale, bias, res, True, s, torch.int8, -127, [1, 1], [1, 1], [1, 1], -1)
    assert q8.dtype == torch.int8 and q8.is_contiguous(memory_format=CL)
    torch.testing.assert_close(q8, torch.clamp(torch.round(want / 0.02), -127, 127).to(torch.int8), atol=1, rtol=0)
    qf = conv2d_q(x.to(torch.float32).to(FP8), w.float().to(FP8), scale, bias, res, True, s, FP8, -128, [1, 1],
                  [1, 1], [1, 1], -1)
    assert qf.dtype == FP8


@pytest.mark.parametrize("fp8", [False, True])
def test_dual_output_is_the_float_output_and_its_quantize(fp8: bool) -> None:
    # conv2d_q_dual's two outputs against conv2d_q's float output and overdrive::quantize of it; export traces it
    dt = FP8 if fp8 else torch.int8
    x = (torch.randn(2, 16, 7, 7) * 20).to(dt).contiguous(memory_format=CL)
    w = (torch.randn(8, 16, 3, 3) * 20).to(dt).contiguous(memory_format=CL)
    scale, bias, res = torch.rand(8) * 1e-3, torch.randn(8), torch.randn(2, 8, 7, 7).contiguous(memory_format=CL)
    s = torch.tensor(0.02)
    y, q = conv2d_q_dual(x, w, scale, bias, res, True, torch.float16, s, -127, fp8, [1, 1], [1, 1], [1, 1], -1)
    want = conv2d_q(x, w, scale, bias, res, True, None, torch.float16, -127, [1, 1], [1, 1], [1, 1], -1)
    assert torch.equal(y, want) and q.dtype == dt and q.is_contiguous(memory_format=CL)
    assert torch.equal(q.float(), quantize(want, s, -127, fp8).float())

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return conv2d_q_dual(x, w, scale, bias, None, False, torch.float16, s, -127, fp8, [1, 1], [1, 1], [1, 1],
                                 -1)

    ep = torch.export.export(M(), (x,))
    got = ep.module()(x)
    assert got[0].dtype == torch.float16 and got[1].dtype == dt


def test_dual_output_needs_a_float_output() -> None:
    x = torch.zeros(1, 16, 4, 4, dtype=torch.int8)
    w = torch.zeros(8, 16, 1, 1, dtype=torch.int8)
    with pytest.raises(UsageError, match="must be a float dtype"):
        conv2d_q_dual(x, w, torch.ones(8), None, None, False, torch.int8, torch.tensor(1.0), -128, False, [1, 1],
                      [0, 0], [1, 1], -1)


@pytest.mark.parametrize("fp8", [False, True])
def test_quantized_residual_is_added_dequantized(fp8: bool) -> None:
    # an int8 / fp8 residual with its scale: the op adds residual * res_scale (fp32 reference written out)
    dt = FP8 if fp8 else torch.int8
    x = (torch.randn(2, 16, 5, 5) * 20).to(dt).contiguous(memory_format=CL)
    w = (torch.randn(8, 16, 1, 1) * 20).to(dt).contiguous(memory_format=CL)
    scale, rs = torch.rand(8) * 1e-3, torch.tensor(0.03)
    r = torch.randn(2, 8, 5, 5).contiguous(memory_format=CL)
    rq = quantize(r, rs, -127, fp8)
    got = conv2d_q(x, w, scale, None, rq, True, None, torch.float32, -128, [1, 1], [0, 0], [1, 1], -1, rs)
    want = torch.relu(F.conv2d(x.double(), w.double()) * scale.double().view(1, -1, 1, 1) + rq.double() * 0.03)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    y, q = conv2d_q_dual(x, w, scale, None, rq, True, torch.float32, rs, -127, fp8, [1, 1], [0, 0], [1, 1], -1, rs)
    torch.testing.assert_close(y, got)


def test_res_scale_goes_with_a_quantized_residual() -> None:
    x = torch.zeros(1, 16, 4, 4, dtype=torch.int8)
    w = torch.zeros(8, 16, 1, 1, dtype=torch.int8)
    one = torch.ones(8)
    with pytest.raises(UsageError, match="res_scale goes with an int8 / fp8 residual"):
        conv2d_q(x, w, one, None, torch.zeros(1, 8, 4, 4, dtype=torch.int8), False, None, torch.float32, -128,
                 [1, 1], [0, 0], [1, 1], -1)
    with pytest.raises(UsageError, match="got a torch.float32 residual and res_scale set"):
        conv2d_q(x, w, one, None, torch.zeros(1, 8, 4, 4), False, None, torch.float32, -128, [1, 1], [0, 0], [1, 1],
                 -1, torch.tensor(1.0))


def test_quantize_op_matches_fake_quant_arithmetic() -> None:
    x = torch.randn(3, 8, 5, 5).contiguous(memory_format=CL) * 3
    s = torch.tensor(0.03)
    q = quantize(x, s, -127, False)
    assert q.dtype == torch.int8 and q.is_contiguous(memory_format=CL)
    assert torch.equal(q, torch.clamp(torch.round(x / s), -127, 127).to(torch.int8))
    assert torch.equal(quantize(x, s, -128, True), (x / s).clamp(-448, 448).to(FP8))


def test_exports_with_both_ops_and_runs_from_the_program() -> None:
    conv = torch.nn.Conv2d(16, 16, 3, padding=1)
    x = torch.randn(1, 16, 8, 8).contiguous(memory_format=CL)
    q = Fp8Conv2d.from_float(conv, x.abs().amax())
    ep = torch.export.export(q, (x,))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.overdrive.quantize.default in targets and torch.ops.overdrive.conv2d_q.default in targets
    torch.testing.assert_close(ep.module()(x), q(x))


def test_bad_inputs_are_refused_with_the_fix() -> None:
    x = torch.randn(1, 16, 4, 4)
    w = torch.randn(8, 16, 1, 1)
    with pytest.raises(UsageError, match="quantize the input"):
        conv2d_q(x, w, torch.ones(8), None, None, False, None, torch.float32, -128, [1, 1], [0, 0], [1, 1], -1)
    xq, wq = x.to(torch.int8), w.to(torch.int8)
    with pytest.raises(UsageError, match="needs out_scale"):
        conv2d_q(xq, wq, torch.ones(8), None, None, False, None, torch.int8, -128, [1, 1], [0, 0], [1, 1], -1)
    assert "groups=2" in unsupported(torch.nn.Conv2d(16, 16, 3, groups=2))
    assert "multiple of 16" in unsupported(torch.nn.Conv2d(3, 16, 7))
    with pytest.raises(UsageError, match="depthwise"):
        Int8Conv2d.from_float(torch.nn.Conv2d(16, 16, 3, groups=16), torch.tensor(1.0))


def test_default_tiles_are_candidates_and_follow_the_measured_choices() -> None:
    # the untuned default for any shape is one of the configs tuning would time for it (its K tile fits the
    # channels, its N tile is no wider than the layer); at ResNet-50's shapes it is the tile the H200 tuning picked
    # (benchmarks/results/lowp_conv.json: same tile where the pick was a near-tie in stages)
    from overdrive.quant.conv_tiles import CONFIGS, candidates, default_config

    for c in (16, 32, 64, 128, 256, 512, 2048):
        for n_out in (16, 64, 96, 128, 256, 1000, 2048):
            for taps in (1, 9, 49):
                for m in (49, 4096, 200704):
                    assert default_config(m, n_out, c, taps) in candidates(c, n_out), (m, n_out, c, taps)
    tile = lambda i: CONFIGS[i][:3]  # noqa: E731
    assert tile(default_config(256 * 56 * 56, 64, 64, 9)) == tile(17)  # 64-channel 3x3 at 56x56
    assert tile(default_config(256 * 28 * 28, 512, 128, 1)) == tile(15)  # 1x1 expansion with residual at 28x28
    assert tile(default_config(256 * 14 * 14, 256, 256, 9)) == tile(1)  # 3x3 at 14x14
    assert tile(default_config(256 * 56 * 56, 64, 256, 1)) == tile(14)  # channel-reducing 1x1 to 64


def test_compile_in_threads_runs_each_call_once_side_by_side(monkeypatch) -> None:
    # the kernel configs a build tunes compile in parallel: after the first call (alone), the others run at once in
    # threads (two calls meet at a barrier, which one-after-another would break), failures are left to the caller;
    # with COMPILE_THREADS = 1 they run one after another
    import threading

    from overdrive.quant import conv as qconv

    for threads, met in ((16, True), (1, False)):
        monkeypatch.setattr(qconv, "COMPILE_THREADS", threads)
        barrier, ran = threading.Barrier(2, timeout=30 if met else 0.01), []

        def meet(tag: str) -> None:
            barrier.wait()
            ran.append(tag)

        def fail() -> None:
            raise RuntimeError("a tile that does not fit")

        qconv.compile_in_threads([lambda: ran.append("first"), lambda: meet("a"), fail, lambda: meet("b")],
                                 torch.device("cpu"))
        assert ran[0] == "first"
        assert (sorted(ran[1:]) == ["a", "b"]) is met


def test_candidates_add_the_gemm_form_for_plain_gemms_only() -> None:
    from overdrive.quant.conv_tiles import CONFIGS, GEMM, candidates

    assert not set(candidates(768, 3072)) & set(GEMM)
    both = candidates(768, 3072, gemm=True)
    assert set(GEMM) - {29} <= set(both) and 29 not in both  # 29: K tiles of 64, for <= 64 input channels
    assert 29 in candidates(64, 256, gemm=True) and all(CONFIGS[i][2] == 64 for i in candidates(64, 256, gemm=True))


def test_agrees_tells_rounding_from_a_wrong_kernel() -> None:
    # tune's guard: rounding (fp16 storage, one 8-bit step here and there) agrees; a tile left unwritten, a wrong
    # shape or a NaN does not (reference: the float tensor itself)
    from overdrive.quant.conv import agrees

    torch.manual_seed(0)
    want = torch.randn(4, 32, 8, 8) * 20
    assert agrees(want.half(), want) and agrees(want.round().clamp(-127, 127).to(torch.int8), want.round())
    holed = want.clone()
    holed[:, :16] = 0  # half the channels never written
    assert not agrees(holed, want)
    assert not agrees(want[:2], want)
    nan = want.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert not agrees(nan, want)


# ---- 16-bit operands: the same kernel and epilogue on fp16 / bf16 x and weight (scale 1, no quantize) ----

def test_fp16_operands_are_taken_and_computed_as_the_float_conv() -> None:
    """conv2d_q takes fp16 / bf16 x and weight of one dtype: the float convolution with the op's epilogue (here on
    the CPU, where the op is its fp32 reference: equal to F.conv2d in fp32 on the same values, 1e-5)."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        x = torch.randn(2, 16, 9, 9, generator=g).to(dt).contiguous(memory_format=CL)
        w = torch.randn(24, 16, 3, 3, generator=g).to(dt).contiguous(memory_format=CL)
        b, z = torch.randn(24, generator=g), torch.randn(2, 24, 9, 9, generator=g).to(dt)
        y = conv2d_q(x, w, torch.ones(24), b, z, True, None, torch.float32, -128, [1, 1], [1, 1], [1, 1], -1)
        ref = torch.relu(F.conv2d(x.float(), w.float(), b, 1, 1) + z.float())
        assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(UsageError, match="of one dtype, got torch.float16 and torch.bfloat16"):
        conv2d_q(x.half(), w, torch.ones(24), None, None, False, None, torch.float32, -128, [1, 1], [1, 1], [1, 1], -1)
