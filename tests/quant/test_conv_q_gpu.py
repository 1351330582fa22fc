"""The int8 / fp8 / 16-bit convolution kernel (quant/_triton_conv.py) compiled for Hopper (wherever Triton is installed:
wgmma, 16-byte stores, shared memory per SM) and run on a GPU against the op's fp32 reference (quant/conv.py)."""

from __future__ import annotations

import pytest
import torch

from overdrive.quant.conv import FP8, Fp8Conv2d, Int8Conv2d, _quantize_ref, _reference, conv2d_q, conv2d_q_dual, quantize

CL = torch.channels_last


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


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
