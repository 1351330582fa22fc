"""Real int8 / fp8 convolutions of any kernel size: the ops ``overdrive::quantize`` and ``overdrive::conv2d_q``,
and the modules :class:`Int8Conv2d` / :class:`Fp8Conv2d` that ``quant.to_real`` puts in place of calibrated
``QuantConv2d`` layers on CUDA.

- ``overdrive::quantize(x, scale, qmin, fp8)``: symmetric per-tensor quantization of an activation, as the fake
  quantization computes it (int8: ``clamp(round(x / scale), qmin, 127)``; fp8 e4m3: ``clamp(x / scale, -448, 448)``).
  A separate op so that an engine can find it and move it into the epilogue of the layer that produces ``x``.
- ``overdrive::dequantize(q, scale, out_dtype)``: ``q * scale`` in ``out_dtype``, its inverse.
- ``overdrive::conv2d_q(x, weight, scale, bias, residual, relu, out_scale, out_dtype, qmin, stride, padding,
  dilation, config, res_scale=None)``: ``relu(conv2d(x, weight) * scale + bias + residual)`` on quantized ``x`` and
  ``weight`` (both
  int8 or both fp8), where ``scale`` (Cout,) is the activation scale times each output channel's weight scale; a
  quantized residual (int8 / fp8) comes with its ``res_scale`` and is added as ``residual * res_scale``. The
  output is ``out_dtype`` (fp16, bf16, fp32) or, with ``out_scale``, the next layer's quantized input (int8 / fp8).
  On CUDA it is one Triton implicit-GEMM kernel on int8 / fp8 tensor cores with all of that in its epilogue
  (``quant/_triton_conv.py``); elsewhere the same function in fp32 (the reference the kernel is tested against).
  Activations and outputs are channels_last.

Example:
    >>> x = torch.randn(2, 16, 8, 8)
    >>> conv = torch.nn.Conv2d(16, 32, 3, padding=1)
    >>> q = Int8Conv2d.from_float(conv, x_amax=x.abs().amax())
    >>> bool(torch.nn.functional.cosine_similarity(q(x).flatten(), conv(x).flatten(), dim=0) > 0.999)
    True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError

FP8 = torch.float8_e4m3fn
ACT_SILU, ACT_GELU = 1, 2  # conv2d_q's ``act``: the activation of its epilogue other than ReLU (GELU: the erf form)
ACTS = {"silu": ACT_SILU, "gelu": ACT_GELU}  # by name, as engines' plans (lowp_conv_fusion.conv_epilogues) say it


def apply_act(y: torch.Tensor, act: int) -> torch.Tensor:
    """``y`` through the epilogue activation ``act`` (0: unchanged), as the reference and the fp16 timing apply it."""
    return F.silu(y) if act == ACT_SILU else F.gelu(y) if act == ACT_GELU else y
_QUANTIZED = (torch.int8, FP8)
_OPERANDS = (*_QUANTIZED, torch.float16, torch.bfloat16)  # x and weight: 8-bit, or 16-bit float (scale 1)


def _quantize_ref(x: torch.Tensor, scale: torch.Tensor, qmin: int, fp8: bool) -> torch.Tensor:
    y = x.float() / scale
    if fp8:
        return y.clamp(-448, 448).to(FP8)
    return torch.clamp(torch.round(y), qmin, 127).to(torch.int8)


@torch.library.custom_op("overdrive::quantize", mutates_args=())
def quantize(x: torch.Tensor, scale: torch.Tensor, qmin: int, fp8: bool) -> torch.Tensor:
    """``x`` quantized with the per-tensor ``scale``: fp8 e4m3 when ``fp8``, else int8 in [``qmin``, 127]; same
    shape and strides as ``x``."""
    return _quantize_ref(x, scale, qmin, fp8)


@quantize.register_kernel("cuda")
def _quantize_cuda(x: torch.Tensor, scale: torch.Tensor, qmin: int, fp8: bool) -> torch.Tensor:
    from overdrive.quant.real import _FUSED  # one fused kernel where compiling is possible (not while capturing)

    return _FUSED(_quantize_ref, x, scale, qmin, fp8)


@quantize.register_fake
def _quantize_fake(x: torch.Tensor, scale: torch.Tensor, qmin: int, fp8: bool) -> torch.Tensor:
    return torch.empty_like(x, dtype=FP8 if fp8 else torch.int8)


@torch.library.custom_op("overdrive::dequantize", mutates_args=())
def dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``out_dtype``: the inverse of ``overdrive::quantize`` (same shape and strides). A separate op
    so that an engine can find a quantized tensor read back in float (a residual quantized by ``quant``'s
    residual-add quantizer) and let the kernel that reads it take the 8-bit tensor instead."""
    return (q.float() * scale.float()).to(out_dtype)


@dequantize.register_fake
def _dequantize_fake(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(q, dtype=out_dtype)


def _out_hw(h: int, w: int, kh: int, kw: int, stride: list[int], padding: list[int], dilation: list[int]
            ) -> tuple[int, int]:
    return ((h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1,
            (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1)


def _empty_out(x: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int],
               dtype: torch.dtype) -> torch.Tensor:
    """The output, (N, Cout, Ho, Wo) channels_last (an NHWC buffer seen as NCHW)."""
    ho, wo = _out_hw(x.shape[2], x.shape[3], weight.shape[2], weight.shape[3], stride, padding, dilation)
    return torch.empty((x.shape[0], ho, wo, weight.shape[0]), dtype=dtype, device=x.device).permute(0, 3, 1, 2)


def _check(x: torch.Tensor, weight: torch.Tensor, out_scale: torch.Tensor | None, out_dtype: torch.dtype,
           residual: torch.Tensor | None = None, res_scale: torch.Tensor | None = None, relu: bool = False,
           act: int = 0) -> None:
    if act not in (0, ACT_SILU, ACT_GELU) or (act and relu):
        raise UsageError(f"overdrive::conv2d_q: act={act} with relu={relu}: act is 0 (none), {ACT_SILU} (SiLU) or "
                         f"{ACT_GELU} (GELU), and replaces the ReLU; pass relu=False with an act")
    if x.dtype not in _OPERANDS or weight.dtype != x.dtype:
        raise UsageError(f"overdrive::conv2d_q takes int8, fp8, fp16 or bf16 x and weight of one dtype, got {x.dtype} "
                         f"and {weight.dtype}; quantize the input with overdrive::quantize first, or cast both")
    if (out_dtype in _QUANTIZED) != (out_scale is not None):
        raise UsageError(f"overdrive::conv2d_q: out_dtype {out_dtype} needs out_scale exactly when it is int8 / fp8")
    quantized_res = residual is not None and residual.dtype in _QUANTIZED
    if quantized_res != (res_scale is not None):
        got = "no residual" if residual is None else f"a {residual.dtype} residual"
        raise UsageError(f"overdrive::conv2d_q: res_scale goes with an int8 / fp8 residual, got {got} and "
                         f"res_scale {'set' if res_scale is not None else 'None'}; pass the residual's quantize scale "
                         "with a quantized residual, and none with a float one")


@torch.library.custom_op("overdrive::conv2d_q", mutates_args=())
def conv2d_q(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor | None, relu: bool, out_scale: torch.Tensor | None, out_dtype: torch.dtype,
             qmin: int, stride: list[int], padding: list[int], dilation: list[int], config: int,
             res_scale: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    """``relu(conv2d(x, weight) * scale + bias + residual)``, in ``out_dtype`` or quantized by ``out_scale``
    (int8 in [``qmin``, 127], or fp8); ``config`` picks the CUDA kernel's tiles (-1: a default); an int8 / fp8
    ``residual`` is dequantized by ``res_scale``; ``act`` (instead of ``relu``): 1 SiLU, 2 GELU (erf), 0 none."""
    _check(x, weight, out_scale, out_dtype, residual, res_scale, relu, act)
    return _reference(x, weight, scale, bias, residual, relu, out_scale, out_dtype, qmin, stride, padding, dilation,
                      res_scale, act)


@conv2d_q.register_kernel("cuda")
def _conv2d_q_cuda(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, relu: bool, out_scale: torch.Tensor | None, out_dtype: torch.dtype,
                   qmin: int, stride: list[int], padding: list[int], dilation: list[int], config: int,
                   res_scale: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    _check(x, weight, out_scale, out_dtype, residual, res_scale, relu, act)
    if not triton_available():
        return _reference(x, weight, scale, bias, residual, relu, out_scale, out_dtype, qmin, stride, padding,
                          dilation, res_scale, act)
    from overdrive.quant import _triton_conv

    xn = _nhwc(x)
    wn = _nhwc(weight)
    out = _empty_out(x, weight, stride, padding, dilation, out_dtype)
    res = None if residual is None else _nhwc(residual)  # any float dtype: the kernel adds it in fp32
    _triton_conv.launch(xn, wn, scale.float().contiguous(), None if bias is None else bias.float().contiguous(), res,
                        relu, out.permute(0, 2, 3, 1), None if out_scale is None else out_scale.float().reshape(1),
                        {torch.int8: 2, FP8: 1}.get(out_dtype, 0), qmin, list(stride), list(padding), list(dilation),
                        config, res_scale=None if res_scale is None else res_scale.float().reshape(1), act=act)
    return out


def _check_dual(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, residual: torch.Tensor | None,
                res_scale: torch.Tensor | None, relu: bool = False, act: int = 0) -> None:
    if out_dtype in _QUANTIZED:
        raise UsageError(f"overdrive::conv2d_q_dual: out_dtype {out_dtype} must be a float dtype (fp16, bf16, fp32): "
                         "the quantized output is the second one; use conv2d_q with out_scale for one quantized output")
    _check(x, weight, None, out_dtype, residual, res_scale, relu, act)


@torch.library.custom_op("overdrive::conv2d_q_dual", mutates_args=())
def conv2d_q_dual(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None, relu: bool, out_dtype: torch.dtype, q_scale: torch.Tensor, qmin: int,
                  q_fp8: bool, stride: list[int], padding: list[int], dilation: list[int], config: int,
                  res_scale: torch.Tensor | None = None, act: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``conv2d_q``'s float output (``out_dtype``) and the same output quantized by ``q_scale`` (fp8 when
    ``q_fp8``, else int8 in [``qmin``, 127]), from one kernel: the dual output of a block whose result is both a
    residual (read in float) and the next convolution's input (read quantized). The quantized tensor equals
    ``overdrive::quantize`` of the float one."""
    _check_dual(x, weight, out_dtype, residual, res_scale, relu, act)
    return _dual_reference(x, weight, scale, bias, residual, relu, out_dtype, q_scale, qmin, q_fp8, stride, padding,
                           dilation, res_scale, act)


@conv2d_q_dual.register_kernel("cuda")
def _conv2d_q_dual_cuda(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor | None, relu: bool, out_dtype: torch.dtype, q_scale: torch.Tensor,
                        qmin: int, q_fp8: bool, stride: list[int], padding: list[int], dilation: list[int],
                        config: int, res_scale: torch.Tensor | None = None, act: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_dual(x, weight, out_dtype, residual, res_scale, relu, act)
    if not triton_available():
        return _dual_reference(x, weight, scale, bias, residual, relu, out_dtype, q_scale, qmin, q_fp8, stride,
                               padding, dilation, res_scale, act)
    from overdrive.quant import _triton_conv

    out = _empty_out(x, weight, stride, padding, dilation, out_dtype)
    q = _empty_out(x, weight, stride, padding, dilation, FP8 if q_fp8 else torch.int8)
    _triton_conv.launch(_nhwc(x), _nhwc(weight), scale.float().contiguous(),
                        None if bias is None else bias.float().contiguous(),
                        None if residual is None else _nhwc(residual), relu, out.permute(0, 2, 3, 1), None, 0, qmin,
                        list(stride), list(padding), list(dilation), config, q_out=q.permute(0, 2, 3, 1),
                        q_scale=q_scale.float().reshape(1), q_mode=1 if q_fp8 else 2,
                        res_scale=None if res_scale is None else res_scale.float().reshape(1), act=act)
    return out, q


@conv2d_q_dual.register_fake
def _conv2d_q_dual_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor | None, relu: bool, out_dtype: torch.dtype, q_scale: torch.Tensor,
                        qmin: int, q_fp8: bool, stride: list[int], padding: list[int], dilation: list[int],
                        config: int, res_scale: torch.Tensor | None = None, act: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return (_empty_out(x, weight, stride, padding, dilation, out_dtype),
            _empty_out(x, weight, stride, padding, dilation, FP8 if q_fp8 else torch.int8))


def _dual_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None, relu: bool, out_dtype: torch.dtype, q_scale: torch.Tensor,
                    qmin: int, q_fp8: bool, stride: list[int], padding: list[int], dilation: list[int],
                    res_scale: torch.Tensor | None = None, act: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    y = _reference(x, weight, scale, bias, residual, relu, None, out_dtype, qmin, stride, padding, dilation,
                   res_scale, act)
    q = _empty_out(x, weight, stride, padding, dilation, FP8 if q_fp8 else torch.int8)
    return y, q.copy_(_quantize_ref(y, q_scale, qmin, q_fp8))


def _reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                         residual: torch.Tensor | None, relu: bool, out_scale: torch.Tensor | None,
                         out_dtype: torch.dtype, qmin: int, stride: list[int], padding: list[int],
                         dilation: list[int], res_scale: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    """The op as fp32 arithmetic on ``x``'s device: products of int8 / fp8 values are exact in fp32."""
    y = F.conv2d(x.float(), weight.float(), None, stride, padding, dilation) * scale.view(1, -1, 1, 1)
    if bias is not None:
        y = y + bias.float().view(1, -1, 1, 1)
    if residual is not None:
        y = y + (residual.float() if res_scale is None else residual.float() * res_scale.float())
    if relu:
        y = torch.relu(y)
    y = apply_act(y, act)
    if out_scale is not None:
        y = _quantize_ref(y, out_scale, qmin, out_dtype == FP8)
    return _empty_out(x, weight, stride, padding, dilation, out_dtype).copy_(y)


@conv2d_q.register_fake
def _conv2d_q_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, relu: bool, out_scale: torch.Tensor | None, out_dtype: torch.dtype,
                   qmin: int, stride: list[int], padding: list[int], dilation: list[int], config: int,
                   res_scale: torch.Tensor | None = None, act: int = 0) -> torch.Tensor:
    return _empty_out(x, weight, stride, padding, dilation, out_dtype)


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    """An (N, C, H, W) tensor's memory as a contiguous (N, H, W, C) tensor (a view when it is channels_last)."""
    v = t.permute(0, 2, 3, 1)
    return v if v.is_contiguous() else v.contiguous()


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (the CUDA kernel of ``conv2d_q``); the op falls back to the reference otherwise."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken Triton install is as good as none
        return False
    return True


COMPILE_THREADS = 16  # at most this many kernel configs compile at once (0 or 1: one after another)


def compile_in_threads(calls: list[Callable[[], Any]], device: torch.device) -> None:
    """Run each of ``calls`` once, up to :data:`COMPILE_THREADS` at a time, so that the Triton kernels they launch
    compile side by side: Triton's compile (MLIR, LLVM, ptxas) runs mostly outside the GIL, and a build tunes 10-20
    tile configs per kernel kind, each a compile of about a second. The first call runs alone (it sets up Triton's
    per-device caches); a call that fails (a tile that does not fit this GPU) is left for the caller to meet again.

    Example:
        >>> compile_in_threads([], torch.device("cpu"))  # nothing to run
    """
    import concurrent.futures

    def run(fn: Callable[[], Any]) -> None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            try:
                fn()
            except Exception:  # noqa: BLE001 - the caller's own call of it reports or skips the failure
                pass

    if not calls:
        return
    run(calls[0])
    workers = min(len(calls) - 1, COMPILE_THREADS)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(run, calls[1:]))
    else:
        for fn in calls[1:]:
            run(fn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agrees(got: torch.Tensor, want: torch.Tensor, min_cosine: float = 0.999) -> bool:
    """Whether a kernel config's output is the reference's up to rounding (8-bit steps, fp8 sums): finite, same
    shape, cosine >= ``min_cosine``. ``tune`` skips a config that fails it (a miscompiled or mis-tiled kernel on some
    GPU or Triton version), so tuning can never pick a wrong kernel for being fast.

    Example:
        >>> y = torch.randn(2, 8, 4, 4)
        >>> agrees(y.half(), y), agrees(torch.zeros_like(y), y)
        (True, False)
    """
    g, w = got.float().flatten(), want.float().flatten()
    if g.shape != w.shape or not bool(torch.isfinite(g).all()):
        return False
    return bool(F.cosine_similarity(g, w, dim=0) >= min_cosine)


def tune(x: torch.Tensor, weight: torch.Tensor, *, residual: bool = False, relu: bool = False,
         out_dtype: torch.dtype = torch.float16, stride: list[int] | tuple[int, ...] = (1, 1),
         padding: list[int] | tuple[int, ...] = (0, 0), dilation: list[int] | tuple[int, ...] = (1, 1)
         ) -> tuple[int, float]:
    """The fastest kernel config for this problem on ``x``'s GPU and its time in ms: every config timed on random
    data of these shapes (CUDA graph replays, median), among those whose output :func:`agrees` with the op's fp32
    reference on that data. ``x``/``weight`` give shapes, dtypes and device only.

    Example:
        >>> # cfg, ms = tune(xq, wq, relu=True, padding=[1, 1])   # CUDA only
    """
    from overdrive._utils.timing import time_fn
    from overdrive.quant.conv_tiles import candidates

    dev = x.device
    if dev.type != "cuda":
        raise UsageError("quant.conv.tune times the CUDA kernel; give CUDA tensors")
    g = torch.Generator(device="cpu").manual_seed(0)
    xq = (torch.randn(tuple(x.shape), generator=g) * 8).to(dev).to(x.dtype).contiguous(memory_format=torch.channels_last)
    wq = (torch.randn(tuple(weight.shape), generator=g) * 8).to(dev).to(weight.dtype)
    wq = wq.contiguous(memory_format=torch.channels_last)
    cout = weight.shape[0]
    scale = torch.full((cout,), 1e-3, device=dev)
    bias = torch.zeros(cout, device=dev)
    st, pd, dl = list(stride), list(padding), list(dilation)
    ho, wo = _out_hw(x.shape[2], x.shape[3], weight.shape[2], weight.shape[3], st, pd, dl)
    res = torch.randn(x.shape[0], cout, ho, wo, device=dev, dtype=torch.float16).contiguous(
        memory_format=torch.channels_last) if residual else None
    quantized_out = out_dtype in _QUANTIZED
    out_scale = torch.ones((), device=dev) if quantized_out else None
    best: tuple[int, float] = (-1, float("inf"))
    plain_gemm = weight.shape[2] == weight.shape[3] == 1 and list(stride) == [1, 1] and list(padding) == [0, 0]
    cands = candidates(x.shape[1], cout, gemm=plain_gemm and (x.shape[1] * x.element_size()) % 16 == 0)

    def call(i: int) -> Any:
        return conv2d_q(xq, wq, scale, bias, res, relu, out_scale, out_dtype, -128, st, pd, dl, i)

    compile_in_threads([functools.partial(call, i) for i in cands], dev)
    with torch.no_grad():  # what every config must compute: a tile that computes something else is never picked
        want = _reference(xq, wq, scale, bias, res, relu, out_scale, out_dtype, -128, st, pd, dl)
    for i in cands:
        try:
            if not agrees(call(i), want):
                continue
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    call(i)
            ms = 1e3 * sorted(time_fn(graph.replay, dev, warmup=2, repeat=7))[3] / 10
        except Exception:  # noqa: BLE001 - a config that does not fit this GPU (shared memory): skip it
            continue
        if ms < best[1]:
            best = (i, ms)
    return best


def keep_dtypes(module: nn.Module, names: tuple[str, ...], fn: Callable[[torch.Tensor], torch.Tensor],
                apply: Callable[[], Any]) -> Any:
    """``apply()`` (a module's ``_apply(fn)``), with the buffers ``names`` moved by ``fn`` to its device but kept in
    their dtype: ``model.half()`` must not turn 8-bit weights into fp16 ones nor fp32 scales (down to 1e-8) into
    fp16 ones that underflow (a real int8 model ran 17% off its fake-quant twin after ``.half()``)."""
    kept = {n: module._buffers[n] for n in names if module._buffers.get(n) is not None}
    out = apply()
    for n, old in kept.items():
        new = module._buffers[n]
        if new is not None and new.dtype != old.dtype:
            module._buffers[n] = old.to(device=new.device)
    return out


class Int8Conv2d(nn.Module):
    """A convolution (any kernel size, stride, padding, dilation; groups 1) on int8 tensor cores: static per-tensor
    activation scale (calibrated amax / 127), int8 weights per output channel, one ``overdrive::conv2d_q`` call
    (Triton on CUDA). Built from a calibrated ``QuantConv2d`` by ``quant.to_real`` (on CUDA), or with
    :meth:`from_float`.

    Example:
        >>> conv = torch.nn.Conv2d(16, 16, 3, padding=1)
        >>> q = Int8Conv2d.from_float(conv, x_amax=torch.tensor(4.0))
        >>> q(torch.randn(1, 16, 8, 8)).shape
        torch.Size([1, 16, 8, 8])
    """

    fmt = "int8"

    def __init__(self, weight: torch.Tensor, w_amax: torch.Tensor, x_amax: torch.Tensor, bias: torch.Tensor | None,
                 stride: Any = 1, padding: Any = 0, dilation: Any = 1, x_qmin: int = -128, w_qmin: int = -127) -> None:
        super().__init__()
        bound = 127.0 if self.fmt == "int8" else 448.0
        w = weight.detach().float()
        w_scale = (w_amax.detach().float().to(w.device).clamp_min(1e-12) / bound).reshape(-1)
        if w_scale.numel() == 1:
            w_scale = w_scale.expand(w.shape[0]).clone()
        ws = w_scale.view(-1, 1, 1, 1)
        q = torch.clamp(torch.round(w / ws), w_qmin, 127).to(torch.int8) if self.fmt == "int8" else \
            (w / ws).clamp(-448, 448).to(FP8)
        x_scale = x_amax.detach().float().to(w.device).clamp_min(1e-12).reshape(()) / bound
        self.register_buffer("w_q", q.contiguous(memory_format=torch.channels_last))  # (Cout, C, KH, KW) NHWC memory
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("x_scale", x_scale)
        self.register_buffer("scale", (x_scale * w_scale).contiguous())  # (Cout,) fp32, the epilogue's factor
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.stride, self.padding, self.dilation = _pair(stride), _pair(padding), _pair(dilation)
        self.x_qmin = x_qmin
        self.in_channels, self.out_channels = w.shape[1], w.shape[0]
        self.kernel_size = (w.shape[2], w.shape[3])
        self.config = -1  # the kernel's tile config (quant.conv.tune); -1: a default by problem size

    @classmethod
    def from_float(cls, conv: nn.Conv2d, x_amax: torch.Tensor, w_amax: torch.Tensor | None = None) -> Int8Conv2d:
        """From a float ``nn.Conv2d`` and its input's amax (``w_amax``: per output channel, default the weights')."""
        reason = unsupported(conv)
        if reason:
            raise UsageError(f"{cls.__name__}.from_float: {reason}")
        w = conv.weight.detach()
        if w_amax is None:
            w_amax = w.float().abs().amax(dim=(1, 2, 3))
        return cls(w, w_amax, x_amax, conv.bias, conv.stride, conv.padding, conv.dilation)

    _KEEP_DTYPES = ("w_q", "w_scale", "x_scale", "scale", "bias")  # 8-bit weights, fp32 scales and epilogue bias

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        return keep_dtypes(self, self._KEEP_DTYPES, fn, lambda: super(Int8Conv2d, self)._apply(fn, recurse))

    @property
    def in_features(self) -> int:  # the per-layer timing's name for the GEMM's K and N sizes
        return self.in_channels

    @property
    def out_features(self) -> int:
        return self.out_channels

    rowwise = False

    def dequantized_weight(self) -> torch.Tensor:
        """The weights the kernel computes with, as fp32 (Cout, C, KH, KW)."""
        return self.w_q.float() * self.w_scale.view(-1, 1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, H, W), best channels_last
        xq = torch.ops.overdrive.quantize(x, self.x_scale, self.x_qmin, self.fmt == "fp8")
        out_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        return torch.ops.overdrive.conv2d_q(xq, self.w_q, self.scale, self.bias, None, False, None, out_dtype, -128,
                                            self.stride, self.padding, self.dilation, self.config)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, {self.fmt}")


class Fp8Conv2d(Int8Conv2d):
    """:class:`Int8Conv2d` on fp8 e4m3 tensor cores (scales amax / 448); CUDA compute capability 8.9+ for speed.

    Example:
        >>> conv = torch.nn.Conv2d(16, 16, 1)
        >>> Fp8Conv2d.from_float(conv, x_amax=torch.tensor(4.0)).w_q.dtype
        torch.float8_e4m3fn
    """

    fmt = "fp8"


def _pair(v: Any) -> list[int]:
    return [int(i) for i in v] if isinstance(v, (tuple, list)) else [int(v), int(v)]


def unsupported(conv: nn.Module) -> str | None:
    """Why a convolution cannot run as :class:`Int8Conv2d` / :class:`Fp8Conv2d` (None when it can)."""
    if not isinstance(conv, nn.Conv2d):
        return f"{type(conv).__name__} is not a 2-D convolution"
    if conv.groups != 1:
        return f"groups={conv.groups} (grouped / depthwise convolutions have no int8/fp8 kernel here)"
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return f"padding {conv.padding!r} / padding_mode {conv.padding_mode!r} (zero padding by numbers only)"
    if conv.in_channels % 16:
        return f"in_channels={conv.in_channels} not a multiple of 16 (the tensor cores' K step)"
    return None
