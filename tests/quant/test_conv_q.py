"""Real int8 / fp8 convolutions (quant/conv.py): the op's reference against float convolutions (CPU), the Triton
kernel against that reference (GPU), the modules, export, and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overdrive._utils.errors import UsageError
from overdrive.quant.conv import (FP8, Fp8Conv2d, Int8Conv2d, _quantize_ref, _reference, conv2d_q, conv2d_q_dual, quantize,
                                  unsupported)

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


# ---- wherever Triton is installed (no GPU needed): what the kernel compiles to for Hopper ----

def _compile_sm90(is_int: bool, cfg: int, out_q: int, res_q: bool = False):
    """The conv kernel compiled for sm_90 without a GPU (``_triton_conv.compile_offline``)."""
    pytest.importorskip("triton")
    from overdrive.quant import _triton_conv as tc

    return tc.compile_offline(is_int, cfg, out_q, res_q)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_kernel_compiles_to_wgmma_with_16_byte_stores(fmt: str) -> None:
    # Hopper's warp-group MMA on 8-bit operands, and the epilogue's stores and residual loads 16 bytes wide. With
    # N_OUT left unspecialized (a regression fixed), every output byte was its own store (st.global.b8) and every
    # residual element its own load, which held the 1x1 layers to 0.4-0.9x cuDNN fp16 on the H200.
    import re

    kernel = _compile_sm90(fmt == "int8", 15, out_q=2 if fmt == "int8" else 1)
    ptx = kernel.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.(s32\.s8\.s8|f32\.e4m3\.e4m3)", ptx)
    assert "st.global.v4" in ptx and "ld.global.v4" in ptx
    assert not re.search(r"st\.global\.(b8|u8)\b", ptx)
    q = _compile_sm90(fmt == "int8", 15, out_q=0, res_q=True)  # an 8-bit residual is read 16 bytes at a time too
    assert "ld.global.v4" in q.asm["ptx"] and not re.search(r"ld\.global\.(b8|u8)\b", q.asm["ptx"])


# ---- GPU: the Triton kernel against the op's fp32 reference on the same quantized inputs ----

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [
    # (N, C, H, W, Cout, k, stride, pad, dilation): odd sizes, Cout not a multiple of any tile, strides, dilation
    (2, 64, 15, 13, 40, 3, 1, 1, 1), (3, 32, 17, 17, 96, 3, 2, 1, 1), (4, 128, 7, 7, 256, 1, 1, 0, 1),
    (1, 48, 9, 11, 16, 5, 1, 2, 1), (2, 16, 12, 12, 24, 3, 1, 2, 2), (8, 256, 14, 14, 1024, 1, 2, 0, 1),
])
# -1: the default (a different tile per shape); 22: persistent; 26 / 28: the GEMM form (TMA; split / whole epilogue),
# which the 1x1 stride-1 shape runs and the others leave for the default tile
@pytest.mark.parametrize("config", [-1, 0, 18, 22, 26, 28])
def test_triton_kernel_matches_reference(fmt, shape, config) -> None:
    from overdrive.quant import _triton_conv  # noqa: F401 - Triton must be there on the GPU machine

    n, c, h, w, cout, k, s, p, d = shape
    dev = torch.device("cuda")
    dt = FP8 if fmt == "fp8" else torch.int8
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    xf = torch.randn(n, c, h, w, generator=g) * 40
    wf = torch.randn(cout, c, k, k, generator=g) * 40
    if fmt == "int8":
        xq, wq = xf.round().clamp(-128, 127).to(dt), wf.round().clamp(-127, 127).to(dt)
    else:
        xq, wq = xf.clamp(-448, 448).to(dt), wf.clamp(-448, 448).to(dt)
    xq = xq.to(dev).contiguous(memory_format=CL)
    wq = wq.to(dev).contiguous(memory_format=CL)
    scale = (torch.rand(cout, generator=g) * 1e-4).to(dev)
    bias = torch.randn(cout, generator=g).to(dev)
    ho = (h + 2 * p - d * (k - 1) - 1) // s + 1
    wo = (w + 2 * p - d * (k - 1) - 1) // s + 1
    res = torch.randn(n, cout, ho, wo, generator=g).half().to(dev).contiguous(memory_format=CL)
    args = ([s, s], [p, p], [d, d])
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the reference in IEEE fp32
    try:
        for residual, relu in ((None, False), (res, True)):
            out = torch.full((n, cout, ho, wo), float("nan"), device=dev)  # poisoned: every element must be written
            got = conv2d_q(xq, wq, scale, bias, residual, relu, None, torch.float32, -128, *args, config)
            out.copy_(got)
            ref = _reference(xq, wq, scale, bias, residual, relu, None, torch.float32, -128, *args)
            assert not out.isnan().any()
            # int8: exact products, int32 sums: equal up to the fp32 epilogue. fp8: Hopper's fp8 MMA adds its products
            # at less than fp32 precision (measured 2e-4..1.4e-3 relative at K = 64..4608), far under fp8's rounding
            tol = 1e-5 if fmt == "int8" else 3e-3
            assert ((out - ref).norm() / ref.norm()).item() < tol
            osc = torch.tensor(0.05, device=dev)
            qgot = conv2d_q(xq, wq, scale, bias, residual, relu, osc, dt, -127, *args, config)
            qref = _reference(xq, wq, scale, bias, residual, relu, osc, dt, -127, *args)
            assert qgot.dtype == dt and qgot.stride() == qref.stride()
            # at most one quantization step apart (a value at a rounding tie may go either way), and rarely
            diff = (qgot.float() - qref.float()).abs()
            step = 1.0 if fmt == "int8" else qref.float().abs().clamp_min(1.0) / 8  # e4m3: 3 mantissa bits
            assert (diff <= step + 1e-6).all()
            # int8: exact sums, so only ties; fp8: the MMA's reduced-precision sums move ~1% of values one step
            assert (diff > 0).float().mean().item() < (0.01 if fmt == "int8" else 0.03)
            # the dual output: the fp16 result and that result quantized, from one kernel
            dgot, dq = conv2d_q_dual(xq, wq, scale, bias, residual, relu, torch.float16, osc, -127, fmt == "fp8",
                                     *args, config)
            assert dgot.dtype == torch.float16 and dq.dtype == dt and dq.stride() == qref.stride()
            assert ((dgot.float() - ref).norm() / ref.norm()).item() < max(tol, 1e-3)  # fp16 rounding of the output
            # the quantized tensor is the quantize of the fp16 one (the kernel's fp32 division may round a tie apart)
            qd = (dq.float() - _quantize_ref(dgot, osc, -127, fmt == "fp8").float()).abs()
            qstep = 1.0 if fmt == "int8" else dgot.float().abs().div(0.05).clamp_min(1.0) / 8
            assert (qd <= qstep + 1e-6).all() and (qd > 0).float().mean().item() < 1e-3
            if residual is not None:  # a quantized residual, dequantized by its scale in the epilogue
                rs = torch.tensor(0.02, device=dev)
                rq = quantize(residual, rs, -127, fmt == "fp8")
                got = conv2d_q(xq, wq, scale, bias, rq, relu, None, torch.float32, -128, *args, config, rs)
                ref = _reference(xq, wq, scale, bias, rq, relu, None, torch.float32, -128, *args, rs)
                assert ((got - ref).norm() / ref.norm()).item() < tol
    finally:
        torch.backends.cudnn.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [Int8Conv2d, Fp8Conv2d])
def test_module_on_gpu_matches_float_conv(cls) -> None:
    conv = torch.nn.Conv2d(64, 128, 3, stride=2, padding=1).cuda()
    x = torch.randn(8, 64, 28, 28, device="cuda").contiguous(memory_format=CL)
    q = cls.from_float(conv, x.abs().amax())
    with torch.no_grad():
        y, ref = q(x.half()), conv(x)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=CL)
    assert _cos(y, ref) > (0.999 if cls is Int8Conv2d else 0.995)


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


def test_persistent_configs_fit_their_programs_per_sm_in_shared_memory() -> None:
    # a persistent grid sized beyond what fits one SM would run in two waves; every variant of the kernel (int8 /
    # fp8, float / 8-bit output, float / 8-bit residual) compiled for sm_90 must fit PERSISTENT[i] programs in
    # Hopper's 227 KB (232448 bytes) of shared memory per SM, 1 KB reserved per program
    pytest.importorskip("triton")
    from overdrive.quant import _triton_conv as tc
    from overdrive.quant.conv_tiles import PERSISTENT

    for cfg, per_sm in PERSISTENT.items():
        for is_int in (True, False):
            for out_q, res_q in ((0, False), (2 if is_int else 1, True)):
                shared = tc.compile_offline(is_int, cfg, out_q, res_q).metadata.shared
                assert per_sm * (shared + 1024) <= 232448, (cfg, is_int, out_q, shared)


_INTERPRETED = """
import os, sys, types
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
import triton.language as tl
from triton.runtime.interpreter import TensorHandle
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference

def rint(x, _semantic=None):  # the interpreter has no libdevice.rint: numpy's (round half to even, as cvt.rni)
    return tl.core.tensor(TensorHandle(np.rint(x.handle.data), x.handle.dtype.scalar), x.type)

tc._conv_tile.fn.__globals__["libdevice"] = types.SimpleNamespace(rint=rint)
torch.manual_seed(0)
cfg = int(sys.argv[1])
n, c, h, co = 4, 64, 16, 160  # M = 1024 pixels: more tiles than the interpreter's persistent programs (4 per SM)
x = (torch.randn(n, c, h, h) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 1, 1) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
scale, bias = torch.rand(co) * 1e-3, torch.randn(co)
res = (torch.randn(n, co, h, h) * 30).clamp(-127, 127).to(torch.int8).contiguous(memory_format=torch.channels_last)
rs, osc = torch.tensor(0.03), torch.tensor(0.05)
ref = _reference(x, w, scale, bias, res, True, osc, torch.int8, -128, [1, 1], [0, 0], [1, 1], rs)
out = torch.empty(n, h, h, co, dtype=torch.int8)
tc.launch(_nhwc(x), _nhwc(w), scale, bias, _nhwc(res), True, out, osc.reshape(1), 2, -128, [1, 1], [0, 0], [1, 1],
          cfg, res_scale=rs.reshape(1))
print("MISMATCH", (out.permute(0, 3, 1, 2) != ref).float().mean().item())
"""


def test_gemm_configs_compile_to_tma_and_wgmma_within_shared_memory() -> None:
    # the GEMM form (one persistent program per SM): operands by TMA (cp.async.bulk.tensor), Hopper's warp-group MMA,
    # no register spills, every variant (int8 / fp8, float / 8-bit output, float / 8-bit residual, GELU) in the
    # 227 KB of shared memory of an SM (1 KB reserved)
    pytest.importorskip("triton")
    from overdrive.quant import _triton_conv as tc
    from overdrive.quant.conv_tiles import GEMM

    for cfg, (_, per_sm) in GEMM.items():
        for is_int in (True, False):
            for out_q, res_q, act in ((0, False, 0), (2 if is_int else 1, True, 2)):
                kernel = tc.compile_offline(is_int, cfg, out_q, res_q, act=act)
                ptx = kernel.asm["ptx"]
                assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx, cfg
                assert "ld.local" not in ptx, (cfg, is_int, out_q)
                assert per_sm * (kernel.metadata.shared + 1024) <= 232448, (cfg, is_int, out_q, kernel.metadata.shared)


def test_candidates_add_the_gemm_form_for_plain_gemms_only() -> None:
    from overdrive.quant.conv_tiles import CONFIGS, GEMM, candidates

    assert not set(candidates(768, 3072)) & set(GEMM)
    both = candidates(768, 3072, gemm=True)
    assert set(GEMM) - {29} <= set(both) and 29 not in both  # 29: K tiles of 64, for <= 64 input channels
    assert 29 in candidates(64, 256, gemm=True) and all(CONFIGS[i][2] == 64 for i in candidates(64, 256, gemm=True))


_GEMM_INTERPRETED = """
import os, sys, types
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch
import triton.language as tl
from triton.runtime.interpreter import TensorHandle
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference

def rint(x, _semantic=None):
    return tl.core.tensor(TensorHandle(np.rint(x.handle.data), x.handle.dtype.scalar), x.type)

tc._conv_tile.fn.__globals__["libdevice"] = types.SimpleNamespace(rint=rint)
torch.manual_seed(0)
cfg, act = int(sys.argv[1]), int(sys.argv[2])
m, c, co = 300, 96, 160  # M and N not multiples of the tiles, K not a multiple of the K tile
x = (torch.randn(m, c, 1, 1) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 1, 1) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
scale, bias = torch.rand(co) * 1e-3, torch.randn(co)
res = (torch.randn(m, co, 1, 1) * 30).clamp(-127, 127).to(torch.int8).contiguous(memory_format=torch.channels_last)
rs, osc = torch.tensor(0.03), torch.tensor(0.05)
ref = _reference(x, w, scale, bias, res, act == 0, osc, torch.int8, -128, [1, 1], [0, 0], [1, 1], rs, act)
out = torch.empty(m, 1, 1, co, dtype=torch.int8)
assert tc.gemm_applies(_nhwc(x), _nhwc(w), [1, 1], [0, 0])
tc.launch(_nhwc(x), _nhwc(w), scale, bias, _nhwc(res), act == 0, out, osc.reshape(1), 2, -128, [1, 1], [0, 0],
          [1, 1], cfg, res_scale=rs.reshape(1), act=act)
d = (out.permute(0, 3, 1, 2).float() - ref.float()).abs()
print("MISMATCH", (d > 0).float().mean().item(), d.max().item())
"""


@pytest.mark.parametrize("cfg,act", [(26, 2), (28, 0), (29, 1)])
def test_gemm_form_matches_the_reference_in_the_interpreter(cfg: int, act: int) -> None:
    # the GEMM form on the Triton interpreter: TMA loads zero-filling past M, N and K, the persistent tile loop, the
    # split and whole epilogues; int8 with an 8-bit residual, ReLU / SiLU / GELU and an int8 output: equal to the fp32
    # reference (exact: int32 sums, the same fp32 epilogue)
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run([sys.executable, "-c", _GEMM_INTERPRETED, str(cfg), str(act)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": src})
    if act != 2:
        assert "MISMATCH 0.0 0.0" in done.stdout, done.stderr[-2000:]
    else:  # GELU into an 8-bit output takes its tanh form (within 4.8e-4 of erf's): a rare one-step flip
        share, worst = (float(v) for v in done.stdout.split("MISMATCH")[1].split())
        assert worst <= 1.0 and share < 0.01, (share, worst, done.stderr[-2000:])


@pytest.mark.parametrize("cfg", [21, 22])
def test_persistent_tiles_match_the_reference_in_the_interpreter(cfg: int) -> None:
    # the persistent kernel (each program loops over several tiles, N tiles partly masked) on the Triton interpreter,
    # int8 with an 8-bit residual and an int8 output: equal to the fp32 reference (reference: _reference, exact)
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    from overdrive.quant.conv_tiles import PERSISTENT

    assert cfg in PERSISTENT
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED, str(cfg)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": src})
    assert "MISMATCH 0.0" in done.stdout, done.stderr[-2000:]


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


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("act", [1, 2])  # SiLU, GELU (erf)
@pytest.mark.parametrize("config", [-1, 22])
def test_triton_kernel_activations_match_reference(fmt: str, act: int, config: int) -> None:
    # the SiLU / GELU epilogue (EfficientNet-style blocks) after a residual, float and dual outputs, against the
    # op's fp32 reference (TF32 off): relative error as the ReLU cases
    dev = torch.device("cuda")
    dt = FP8 if fmt == "fp8" else torch.int8
    g = torch.Generator().manual_seed(act)
    xq = (torch.randn(4, 64, 14, 14, generator=g) * 40).clamp(-127, 127)
    wq = (torch.randn(96, 64, 1, 1, generator=g) * 40).clamp(-127, 127)
    xq = (xq.round() if fmt == "int8" else xq).to(dt).to(dev).contiguous(memory_format=CL)
    wq = (wq.round() if fmt == "int8" else wq).to(dt).to(dev).contiguous(memory_format=CL)
    scale = (torch.rand(96, generator=g) * 1e-4).to(dev)
    bias = torch.randn(96, generator=g).to(dev)
    res = torch.randn(4, 96, 14, 14, generator=g).half().to(dev).contiguous(memory_format=CL)
    args = ([1, 1], [0, 0], [1, 1])
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        got = conv2d_q(xq, wq, scale, bias, res, False, None, torch.float32, -128, *args, config, None, act)
        ref = _reference(xq, wq, scale, bias, res, False, None, torch.float32, -128, *args, None, act)
        assert ((got - ref).norm() / ref.norm()).item() < (1e-5 if fmt == "int8" else 3e-3)
        osc = torch.tensor(0.05, device=dev)
        dgot, dq = conv2d_q_dual(xq, wq, scale, bias, res, False, torch.float16, osc, -127, fmt == "fp8", *args,
                                 config, None, act)
        assert ((dgot.float() - ref).norm() / ref.norm()).item() < 3e-3
        assert (dq.float() - _quantize_ref(dgot, osc, -127, fmt == "fp8").float()).abs().max().item() <= \
            (1.0 if fmt == "int8" else dgot.float().abs().max().item() / 8)
    finally:
        torch.backends.cudnn.allow_tf32 = old


_INTERPRETED_ACT = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference
torch.manual_seed(0)
n, c, h, co = 2, 64, 8, 48
x = (torch.randn(n, c, h, h) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 3, 3) * 20).clamp(-100, 100).to(torch.int8).contiguous(memory_format=torch.channels_last)
scale, bias = torch.rand(co) * 2e-4, torch.randn(co)
res = torch.randn(n, co, h, h).half().contiguous(memory_format=torch.channels_last)
for act in (1, 2):
    ref = _reference(x, w, scale, bias, res, False, None, torch.float16, -128, [1, 1], [1, 1], [1, 1], None, act)
    out = torch.empty(n, h, h, co, dtype=torch.float16)
    tc.launch(_nhwc(x), _nhwc(w), scale, bias, _nhwc(res), False, out, None, 0, -128, [1, 1], [1, 1], [1, 1], 15,
              act=act)
    assert ref.min() < 0  # the activation's negative lobe is in the data
    print("ACT", act, (out.permute(0, 3, 1, 2).float() - ref.float()).abs().max().item())
"""


def test_activation_epilogue_in_the_interpreter() -> None:
    # the kernel's SiLU and GELU (erf) epilogue after an fp16 residual, on the Triton interpreter, against the op's
    # fp32 reference in fp16 (tolerance: one fp16 step at the outputs' size, 8 here)
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED_ACT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": src})
    diffs = [float(d) for d in re.findall(r"ACT \d ([0-9.e-]+)", done.stdout)]
    assert len(diffs) == 2 and max(diffs) <= 8 / 1024, (done.stdout, done.stderr[-2000:])


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


@pytest.mark.parametrize("operand, cfg", [("fp16", 15), ("bf16", 1), ("fp16", 22)])
def test_16_bit_operands_compile_to_wgmma_within_shared_memory(operand: str, cfg: int) -> None:
    # fp16 / bf16 operands compile to Hopper's 16-bit warp-group MMA, with each config's K tile halved so that a
    # pipeline stage holds the same bytes as with 8-bit operands: the largest tiles (config 1: 128x256, 3 stages)
    # still fit the H200's 227 KiB of shared memory per block
    import re

    pytest.importorskip("triton")
    from overdrive.quant import _triton_conv as tc

    kernel = tc.compile_offline(False, cfg, out_q=0, operand=operand)
    ptx_type = {"fp16": "f16", "bf16": "bf16"}[operand]
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{ptx_type}\.{ptx_type}", kernel.asm["ptx"])
    assert kernel.metadata.shared <= 227 * 1024


_INTERPRETED_FP16 = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from overdrive.quant import _triton_conv as tc
from overdrive.quant.conv import _nhwc, _reference
torch.manual_seed(0)
n, c, h, co = 2, 48, 8, 40
x = torch.randn(n, c, h, h).half().contiguous(memory_format=torch.channels_last)
w = (torch.randn(co, c, 3, 3) / 20).half().contiguous(memory_format=torch.channels_last)
bias, res = torch.randn(co), torch.randn(n, co, h, h).half().contiguous(memory_format=torch.channels_last)
ones = torch.ones(co)
ref = _reference(x, w, ones, bias, res, True, None, torch.float16, -128, [1, 1], [1, 1], [1, 1])
out = torch.empty(n, h, h, co, dtype=torch.float16)
tc.launch(_nhwc(x), _nhwc(w), ones, bias, _nhwc(res), True, out, None, 0, -128, [1, 1], [1, 1], [1, 1], 15)
print("FP16", (out.permute(0, 3, 1, 2).float() - ref.float()).abs().max().item(), ref.float().abs().max().item())
"""


def test_fp16_operands_in_the_interpreter() -> None:
    # a 3x3 fp16 convolution (C 48: the K tile masked in its last step) with bias, fp16 residual and ReLU on the
    # Triton interpreter, against the op's fp32 reference rounded to fp16 (tolerance: two fp16 steps at the output's
    # size, as the interpreter's dot sums in another order)
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    src = str(Path(__file__).resolve().parents[2] / "src")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED_FP16], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": src})
    got = re.findall(r"FP16 ([0-9.e-]+) ([0-9.e-]+)", done.stdout)
    assert got, (done.stdout, done.stderr[-2000:])
    diff, size = map(float, got[0])
    assert diff <= 2 * size / 1024, (diff, size)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", [-1, 1, 18, 22])
def test_triton_kernel_16_bit_operands_match_reference(dt: torch.dtype, config: int) -> None:
    """fp16 / bf16 x and weight on the GPU kernel (K tiles halved) against the op's fp32 reference on the same values:
    within 1e-4 relative (16-bit products are exact in fp32; the MMA sums in fp32), with an fp16 residual, ReLU, and
    an 8-bit output one quantization step apart at most."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    for n, c, h, cout, k, s, p in ((2, 64, 15, 40, 3, 1, 1), (8, 256, 14, 1024, 1, 1, 0), (3, 32, 17, 96, 3, 2, 1)):
        x = torch.randn(n, c, h, h, generator=g).to(dt).to(dev).contiguous(memory_format=CL)
        w = (torch.randn(cout, c, k, k, generator=g) / (c * k * k) ** 0.5).to(dt).to(dev).contiguous(memory_format=CL)
        ho = (h + 2 * p - k) // s + 1
        res = torch.randn(n, cout, ho, ho, generator=g).half().to(dev).contiguous(memory_format=CL)
        ones, bias = torch.ones(cout, device=dev), torch.randn(cout, generator=g).to(dev)
        args = ([s, s], [p, p], [1, 1])
        old = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        try:
            got = conv2d_q(x, w, ones, bias, res, True, None, torch.float32, -128, *args, config)
            ref = _reference(x, w, ones, bias, res, True, None, torch.float32, -128, *args)
            assert ((got - ref).norm() / ref.norm()).item() < 1e-4
            osc = torch.tensor(0.02, device=dev)
            q = conv2d_q(x, w, ones, bias, res, True, osc, torch.int8, -128, *args, config)
            qref = _reference(x, w, ones, bias, res, True, osc, torch.int8, -128, *args)
            assert (q.float() - qref.float()).abs().max().item() <= 1.0
        finally:
            torch.backends.cudnn.allow_tf32 = old
