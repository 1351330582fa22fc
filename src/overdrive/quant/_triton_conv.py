"""The Triton kernel behind ``overdrive::conv2d_q``: an implicit-GEMM convolution on int8 / fp8 tensor cores.

Imported only when a CUDA tensor reaches the op (``import overdrive`` never imports Triton). Layout: activations
NHWC, weights (Cout, KH, KW, C), both K-major as Hopper's int8/fp8 MMA wants them. The GEMM is
``M = N * Ho * Wo`` output pixels by ``Cout`` channels over ``K = KH * KW * C``; each K step reads one (kh, kw) tap
of ``BLOCK_K`` channels for ``BLOCK_M`` pixels (the im2col row, never materialised), with zero padding by mask.

Epilogue, in registers before the one store: ``acc * scale[n] (+ bias[n]) (+ residual) (ReLU)``, then either the
output dtype (fp16 / bf16 / fp32) or the next layer's quantization (``/ out_scale``, clamp, cast to fp8 e4m3 or
round to int8), so a chain of quantized convolutions moves one byte per activation element each way.

Problems that are plain GEMMs (1x1 convolutions with stride 1 and no padding; Linear layers on their 1x1 view) have a
second form, :func:`_gemm_kernel`, chosen by the GEMM-form tile configs (``conv_tiles.GEMM``): operands by TMA, a
persistent tile loop, the same epilogue (:func:`_epilogue`). Build-time tuning times both forms.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from overdrive.quant.conv_tiles import CONFIGS, GEMM, PERSISTENT, default_config

# sizes, strides and paddings vary per layer: compile once per tile config and flags, not per value class. N_OUT and C
# stay specialized (Triton's "divisible by 16" hint): without it the output rows, the residual rows and the input
# pixels are not known to be 16-byte aligned, and every store and load is split into single elements.
@triton.jit(do_not_specialize=["M", "C_BLOCKS", "K_ITERS", "H", "W", "HO", "WO", "SH", "SW", "PH", "PW",
                               "DH", "DW"])
def _conv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr, out_scale_ptr, q_ptr, q_scale_ptr,
                 M, N_OUT, C, C_BLOCKS, K_ITERS, H, W, HO, WO, SH, SW, PH, PW, DH, DW,
                 KH: tl.constexpr, KW: tl.constexpr, IS_INT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_Q: tl.constexpr, RELU: tl.constexpr,
                 OUT_Q: tl.constexpr, Q2: tl.constexpr,
                 QMIN: tl.constexpr, ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr = False, ACT: tl.constexpr = 0):
    # OUT_Q: 0 = out_ptr's float dtype, 1 = fp8 e4m3 (/ out_scale, clamp +-448), 2 = int8 (/ out_scale, rint, clamp)
    # RES_Q: the residual is int8 / fp8, added as residual * res_scale (a block input quantized for its next conv)
    # Q2: 0 = nothing more; 1 / 2 = also write the result quantized (fp8 / int8, by q_scale) to q_ptr (dual output)
    # ACT: the activation after the residual instead of RELU: 0 none, 1 SiLU, 2 GELU (erf)
    # PERSISTENT: a grid of a few programs per SM, each looping over output tiles; the tile loop and the K loop are
    # flattened into one pipelined loop, so the next tile's first loads are in flight during this tile's epilogue
    # (what the 1x1 layers with one or two K steps lack: their time is mostly loads, then the epilogue's traffic)
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N_OUT, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            _conv_tile(tile, x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr, out_scale_ptr, q_ptr,
                       q_scale_ptr, M, N_OUT, C, C_BLOCKS, K_ITERS, H, W, HO, WO, SH, SW, PH, PW, DH, DW, KH, KW,
                       IS_INT, HAS_BIAS, HAS_RES, RES_Q, RELU, OUT_Q, Q2, QMIN, ZERO, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                       ACT)
    else:
        _conv_tile(tl.program_id(0), x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr, out_scale_ptr,
                   q_ptr, q_scale_ptr, M, N_OUT, C, C_BLOCKS, K_ITERS, H, W, HO, WO, SH, SW, PH, PW, DH, DW, KH, KW,
                   IS_INT, HAS_BIAS, HAS_RES, RES_Q, RELU, OUT_Q, Q2, QMIN, ZERO, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                       ACT)


@triton.jit
def _conv_tile(pid, x_ptr, w_ptr, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr, out_scale_ptr, q_ptr,
               q_scale_ptr, M, N_OUT, C, C_BLOCKS, K_ITERS, H, W, HO, WO, SH, SW, PH, PW, DH, DW,
               KH: tl.constexpr, KW: tl.constexpr, IS_INT: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_Q: tl.constexpr, RELU: tl.constexpr,
               OUT_Q: tl.constexpr, Q2: tl.constexpr,
               QMIN: tl.constexpr, ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ACT: tl.constexpr):
    """One BLOCK_M x BLOCK_N output tile ``pid`` (grouped order) of the convolution, epilogue and stores included."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    # grouped order: GROUP_M row tiles share each column tile's weights while they sit in L2
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % group_m)
    pid_n = (pid % in_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels (n, ho, wo), row-major
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N_OUT
    wo = offs_m % WO
    t = offs_m // WO
    ho = t % HO
    nb = t // HO
    hi0 = ho * SH - PH
    wi0 = wo * SW - PW
    k_total = KH * KW * C
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * k_total  # (1, BLOCK_N)

    if IS_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_blocks = C_BLOCKS  # cdiv(C, BLOCK_K); K_ITERS = KH * KW * C_BLOCKS
    for it in range(K_ITERS):
        r = it // c_blocks  # the tap kh * KW + kw
        cb = it - r * c_blocks
        kh = r // KW
        kw = r - kh * KW
        hi = hi0 + kh * DH
        wi = wi0 + kw * DW
        ok = m_ok & (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
        cc = cb * BLOCK_K + offs_k
        c_ok = cc < C
        base = ((nb.to(tl.int64) * H + hi) * W + wi) * C  # (BLOCK_M,) start of each pixel's channels
        a = tl.load(x_ptr + base[:, None] + cc[None, :], mask=ok[:, None] & c_ok[None, :], other=ZERO)
        b = tl.load(w_rows + (r * C + cc)[:, None], mask=n_ok[None, :] & c_ok[:, None], other=ZERO)
        if IS_INT:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc)

    _epilogue(acc, offs_m, offs_n, M, N_OUT, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr, out_scale_ptr, q_ptr,
              q_scale_ptr, HAS_BIAS, HAS_RES, RES_Q, RELU, OUT_Q, Q2, QMIN, ACT)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N_OUT, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr, out_scale_ptr, q_ptr,
              q_scale_ptr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_Q: tl.constexpr, RELU: tl.constexpr,
              OUT_Q: tl.constexpr, Q2: tl.constexpr, QMIN: tl.constexpr, ACT: tl.constexpr):
    """A tile's epilogue and store: rows ``offs_m`` of the (M, N_OUT) row-major output, columns ``offs_n``."""
    m_ok = offs_m < M
    n_ok = offs_n < N_OUT
    y = acc.to(tl.float32) * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * N_OUT + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        if RES_Q:  # masked-off lanes are never stored, so they take no fill value (0.0 would not cast to int8)
            y += tl.load(res_ptr + out_off, mask=mask).to(tl.float32) * tl.load(res_scale_ptr)
        else:
            y += tl.load(res_ptr + out_off, mask=mask, other=0.0).to(tl.float32)
    if RELU:
        y = tl.maximum(y, 0.0)
    if ACT == 1:
        y = y * tl.sigmoid(y)
    elif ACT == 2:
        if OUT_Q != 0 and Q2 == 0:
            # written 8-bit only: GELU's tanh form, as x * sigmoid(1.5958 (x + 0.044715 x^3)) (one exp and one
            # division), within 4.8e-4 of the erf form everywhere (at x = 2.7), which is under 2% of an int8 step
            # of amax 3 and 1/250 of an fp8 step there. libdevice's erf is CUDA-core work the MMAs cannot hide:
            # with it, ViT-B/16's fp8 MLP GEMM with GELU and an 8-bit output (25216x768->3072) took 0.241 ms on an
            # H100, against 0.102 ms for its 2304-wide QKV GEMM without an epilogue (benchmarks/results/lowp_linear.md)
            y = y / (1.0 + tl.exp(-1.5957691216057308 * (y + 0.044715 * y * y * y)))
        else:
            y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    if Q2 != 0:  # quantize the value as stored (rounded to out's dtype), as a quantize reading ``out`` would
        yq = y.to(out_ptr.dtype.element_ty).to(tl.float32) / tl.load(q_scale_ptr)
        if Q2 == 1:
            yq = tl.clamp(yq, -448.0, 448.0)
        else:
            yq = tl.clamp(libdevice.rint(yq), QMIN, 127.0)
        tl.store(q_ptr + out_off, yq.to(q_ptr.dtype.element_ty), mask=mask)
    if OUT_Q == 1:
        y = tl.clamp(y / tl.load(out_scale_ptr), -448.0, 448.0)
    elif OUT_Q == 2:
        y = tl.clamp(libdevice.rint(y / tl.load(out_scale_ptr)), QMIN, 127.0)
    tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


# M (the rows: tokens, or pixels of a 1x1 convolution) varies per call; N_OUT and K stay specialized (alignment hints)
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_desc, b_desc, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr, out_scale_ptr, q_ptr,
                 q_scale_ptr, M, N_OUT, K, IS_INT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                 RES_Q: tl.constexpr, RELU: tl.constexpr, OUT_Q: tl.constexpr, Q2: tl.constexpr, QMIN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SUBTILE: tl.constexpr, ACT: tl.constexpr):
    """The GEMM form of the kernel, for the problems that are plain GEMMs (1x1 convolutions with stride 1 and no
    padding, Linear layers on the 1x1 view): the (M, K) activations and (N_OUT, K) weights arrive by TMA (Hopper's
    bulk tensor copies, ``a_desc`` / ``b_desc``, K tiles zero-filled past K), in a persistent loop over output tiles
    whose epilogue (:func:`_epilogue`, the same as the convolution's) runs while the next tile's loads are in flight.
    ``SUBTILE``: the epilogue in two halves of BLOCK_N / 2 columns (fewer live registers beside the accumulator: an
    erf GELU over a 128 x 256 tile in one piece spills)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    in_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        first_m = (tile // in_group) * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((tile % in_group) % group_m)
        pid_n = (tile % in_group) // group_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if IS_INT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])
            b = b_desc.load([off_n, ki * BLOCK_K])
            if IS_INT:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, b.T, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(halves)
            offs_n0 = off_n + tl.arange(0, BLOCK_N // 2)
            _epilogue(acc0, offs_m, offs_n0, M, N_OUT, scale_ptr, bias_ptr, res_ptr, res_scale_ptr, out_ptr,
                      out_scale_ptr, q_ptr, q_scale_ptr, HAS_BIAS, HAS_RES, RES_Q, RELU, OUT_Q, Q2, QMIN, ACT)
            _epilogue(acc1, offs_m, offs_n0 + BLOCK_N // 2, M, N_OUT, scale_ptr, bias_ptr, res_ptr, res_scale_ptr,
                      out_ptr, out_scale_ptr, q_ptr, q_scale_ptr, HAS_BIAS, HAS_RES, RES_Q, RELU, OUT_Q, Q2, QMIN, ACT)
        else:
            _epilogue(acc, offs_m, off_n + tl.arange(0, BLOCK_N), M, N_OUT, scale_ptr, bias_ptr, res_ptr,
                      res_scale_ptr, out_ptr, out_scale_ptr, q_ptr, q_scale_ptr, HAS_BIAS, HAS_RES, RES_Q, RELU, OUT_Q,
                      Q2, QMIN, ACT)


def gemm_applies(x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int]) -> bool:
    """Whether a convolution is a plain GEMM the TMA kernel can take: 1x1, stride 1, no padding, rows of a multiple
    of 16 bytes, 16-byte aligned bases (``x`` (N, H, W, C) and ``w`` (Cout, 1, 1, C), contiguous)."""
    return (w.shape[1] == 1 and w.shape[2] == 1 and list(stride) == [1, 1] and list(padding) == [0, 0]
            and (x.shape[3] * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and _tma_available(x.device))


@functools.cache
def _tma_available(device: torch.device) -> bool:
    """Host-side TMA descriptors in this Triton and a GPU that has TMA (Hopper on); the interpreter (CPU tensors)
    emulates them."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def _launch_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor | None, relu: bool, out: torch.Tensor, out_scale: torch.Tensor | None,
                 out_q: int, qmin: int, config: int, q_out: torch.Tensor | None, q_scale: torch.Tensor | None,
                 q_mode: int, res_scale: torch.Tensor | None, act: int) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    c = x.shape[3]
    n_out = w.shape[0]
    a2, w2 = x.view(-1, c), w.view(n_out, c)
    m = a2.shape[0]
    bm, bn, bk, warps, stages = CONFIGS[config]
    bk = block_k(bk, x.element_size())
    a_desc = TensorDescriptor.from_tensor(a2, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w2, [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n_out, bn)
    grid = (min(tiles, GEMM[config][1] * _sm_count(x.device)),)
    dummy = scale
    _gemm_kernel[grid](
        a_desc, b_desc, scale, bias if bias is not None else dummy, residual if residual is not None else dummy,
        res_scale if res_scale is not None else dummy, out, out_scale if out_scale is not None else dummy,
        q_out if q_out is not None else dummy, q_scale if q_scale is not None else dummy, m, n_out, c,
        IS_INT=x.dtype == torch.int8, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        RES_Q=res_scale is not None, RELU=relu, OUT_Q=out_q, Q2=q_mode, QMIN=float(qmin), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, GROUP_M=8, SUBTILE=GEMM[config][0], ACT=act, num_warps=warps, num_stages=stages)
    return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter (CPU tensors): any grid size works
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_k(bk: int, element_size: int) -> int:
    """A config's K tile for operands of ``element_size`` bytes: the config's BLOCK_K is in 8-bit elements, so 16-bit
    operands (fp16 / bf16) take half as many per step, with the same bytes in shared memory per pipeline stage (a
    tile that fits for 8-bit fits for 16-bit).

    Example:
        >>> block_k(128, 1), block_k(128, 2), block_k(32, 2)
        (128, 64, 16)
    """
    return max(16, bk // element_size)


def launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None, relu: bool, out: torch.Tensor, out_scale: torch.Tensor | None, out_q: int,
           qmin: int, stride: list[int], padding: list[int], dilation: list[int], config: int,
           q_out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None, q_mode: int = 0,
           res_scale: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    """Runs the kernel. ``x`` (N, H, W, C) and ``w`` (Cout, KH, KW, C) contiguous, int8, fp8, fp16 or bf16; ``out`` (and
    ``residual``, ``q_out``) (N, Ho, Wo, Cout) contiguous; ``scale`` / ``bias`` fp32 (Cout,). With ``q_mode`` 1 / 2
    the result is also written to ``q_out`` as fp8 / int8 by ``q_scale`` (the dual output); an int8 / fp8 ``residual``
    comes with its ``res_scale`` (fp32, one element); ``act`` 1 / 2: SiLU / GELU after the residual."""
    n, h, wd, c = x.shape
    n_out, kh, kw, _ = w.shape
    _, ho, wo, _ = out.shape
    m = n * ho * wo
    if config in GEMM:
        if gemm_applies(x, w, stride, padding):
            return _launch_gemm(x, w, scale, bias, residual, relu, out, out_scale, out_q, qmin, config, q_out, q_scale,
                                q_mode, res_scale, act)
        config = -1  # a GEMM tile for a problem that is no plain GEMM (another engine's timing cache): the default
    config = config if 0 <= config < len(CONFIGS) else default_config(m, n_out, c, kh * kw)
    bm, bn, bk, warps, stages = CONFIGS[config]
    bk = block_k(bk, x.element_size())
    tiles = triton.cdiv(m, bm) * triton.cdiv(n_out, bn)
    per_sm = PERSISTENT.get(config, 0)
    grid = (min(tiles, per_sm * _sm_count(x.device)) if per_sm else tiles,)
    dummy = scale
    _conv_kernel[grid](
        x, w, scale, bias if bias is not None else dummy, residual if residual is not None else dummy,
        res_scale if res_scale is not None else dummy, out,
        out_scale if out_scale is not None else dummy, q_out if q_out is not None else dummy,
        q_scale if q_scale is not None else dummy,
        m, n_out, c, triton.cdiv(c, bk), kh * kw * triton.cdiv(c, bk), h, wd, ho, wo, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
        KH=kh, KW=kw, IS_INT=x.dtype == torch.int8, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        RES_Q=res_scale is not None,
        RELU=relu, OUT_Q=out_q, Q2=q_mode, QMIN=float(qmin), ZERO=0 if x.dtype == torch.int8 else 0.0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        PERSISTENT=bool(per_sm), ACT=act, num_warps=warps, num_stages=stages)
    return out


def compile_offline(is_int: bool, config: int, out_q: int, res_q: bool = False, kh: int = 1, arch: int = 90,
                    persistent: bool | None = None, act: int = 0, operand: str | None = None) -> object:
    """The kernel compiled for ``sm_<arch>`` without a GPU (Triton compiles to PTX and a cubin offline), specialized as
    its JIT specializes it for ResNet-sized layers: pointers, C and N_OUT divisible by 16, the other sizes not, a
    float16 residual (``res_q``: int8) added, ReLU, output ``out_q`` (0 fp16, 1 fp8, 2 int8); ``operand`` "fp16" /
    "bf16" for 16-bit x and weight (``is_int`` then False). For checking the code a change generates
    (``kernel.asm["ptx"]``) and the compile's cost, here.

    Example:
        >>> # compile_offline(True, 15, out_q=2).asm["ptx"]   # needs Triton, no GPU
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bm, bn, bk, warps, stages = CONFIGS[config]
    bk = block_k(bk, 2 if operand else 1)
    if config in GEMM:  # the GEMM form: TMA descriptors for the operands, no convolution geometry
        return _compile_gemm_offline(is_int, config, out_q, res_q, arch, act, operand)
    fn = _conv_kernel
    names = fn.arg_names
    xt = f"*{operand}" if operand else "*i8" if is_int else "*fp8e4nv"
    sig = {n: "i32" for n in names}
    sig.update(x_ptr=xt, w_ptr=xt, scale_ptr="*fp32", bias_ptr="*fp32", res_ptr="*i8" if res_q else "*fp16",
               res_scale_ptr="*fp32", out_ptr={0: "*fp16", 1: "*fp8e4nv", 2: "*i8"}[out_q], out_scale_ptr="*fp32",
               q_ptr="*i8", q_scale_ptr="*fp32")
    const = dict(KH=kh, KW=kh, IS_INT=is_int, HAS_BIAS=True, HAS_RES=True, RES_Q=res_q, RELU=not act, OUT_Q=out_q, Q2=0,
                 QMIN=-128.0, ZERO=0 if is_int else 0.0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                 PERSISTENT=config in PERSISTENT if persistent is None else persistent, ACT=act)
    sig.update({k: "constexpr" for k in const})
    specialized = [i for i, n in enumerate(names) if n.endswith("_ptr") or (n in ("C", "N_OUT") and
                                                                               n not in fn.do_not_specialize)]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in specialized})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def _compile_gemm_offline(is_int: bool, config: int, out_q: int, res_q: bool, arch: int, act: int,
                          operand: str | None) -> object:
    """:func:`compile_offline` for a GEMM-form config (:func:`_gemm_kernel`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bm, bn, bk, warps, stages = CONFIGS[config]
    bk = block_k(bk, 2 if operand else 1)
    fn = _gemm_kernel
    names = fn.arg_names
    xt = operand or ("i8" if is_int else "fp8e4nv")
    sig = {n: "i32" for n in names}
    sig.update(a_desc=f"tensordesc<{xt}[{bm}, {bk}]>", b_desc=f"tensordesc<{xt}[{bn}, {bk}]>", scale_ptr="*fp32",
               bias_ptr="*fp32", res_ptr="*i8" if res_q else "*fp16", res_scale_ptr="*fp32",
               out_ptr={0: "*fp16", 1: "*fp8e4nv", 2: "*i8"}[out_q], out_scale_ptr="*fp32", q_ptr="*i8",
               q_scale_ptr="*fp32")
    const = dict(IS_INT=is_int, HAS_BIAS=True, HAS_RES=True, RES_Q=res_q, RELU=not act, OUT_Q=out_q, Q2=0,
                 QMIN=-128.0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SUBTILE=GEMM[config][0], ACT=act)
    sig.update({k: "constexpr" for k in const})
    specialized = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("N_OUT", "K")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in specialized})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
