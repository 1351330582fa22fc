"""What the competing paths of a low-precision layer cost, as the engine would run each: the float layer (cuDNN /
cuBLAS with their fused epilogues), the quantize pass an 8-bit reader of a float output needs, and a Linear on
cuBLAS's int8/fp8 GEMM with the pass that applies what a fused kernel would have. ``layer_choice`` sets these beside
the low-precision kernel's own time.

    >>> _quantize_ms(torch.randn(64), torch.tensor(0.1), False, torch.device("cpu")) > 0
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from overdrive.engine.kernel_timing import median_ms as _ms

_QUANTIZE: Any = None


def _quantize_ms(y: torch.Tensor, scale: torch.Tensor, fp8: bool, device: torch.device) -> float:
    """ms of quantizing ``y`` in one compiled pass, as Inductor fuses an engine's quantize (eager on CPU). The op's
    own CUDA path runs eagerly under CUDA-graph capture, which would time several passes instead of one."""
    global _QUANTIZE
    from overdrive.quant.conv import _quantize_ref

    if device.type == "cuda" and _QUANTIZE is None:
        _QUANTIZE = torch.compile(_quantize_ref, dynamic=True)
    q = _QUANTIZE if device.type == "cuda" else _quantize_ref
    return _ms(lambda: q(y, scale, -128, fp8), device)


_LIB_PASS: Any = None


def _lib_pass(y: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, relu: bool, act: int,
              qs: torch.Tensor | None, fp8: bool, dual: bool, out_dtype: torch.dtype) -> Any:
    """What follows a cuBLAS int8/fp8 GEMM in an engine, as one pass: the int8 accumulator's rescale and bias, the
    ReLU / activation, and the next layer's quantize (``qs``; ``dual``: the float output too)."""
    from overdrive.quant.conv import _quantize_ref, apply_act

    v = y.float() * scale + bias if y.dtype == torch.int32 else y.float()
    v = apply_act(torch.relu(v) if relu else v, act)
    if qs is None:
        return v.to(out_dtype)
    q = _quantize_ref(v, qs, -128, fp8)
    return (v.to(out_dtype), q) if dual else q


def _library_linear_ms(lib: nn.Module, xq: torch.Tensor, relu: bool, act: int, out_kind: str, qs: torch.Tensor,
                       out_dtype: torch.dtype, device: torch.device) -> float:
    """ms of a Linear layer on cuBLAS's int8 / fp8 GEMM (``lib``, an ``Int8Linear`` / ``Fp8Linear``) on its quantized
    input ``xq`` (M, K), with the pass that an engine runs after it (:func:`_lib_pass`; none for an fp8 GEMM whose
    float output is all that is read: its bias is in the GEMM)."""
    global _LIB_PASS
    from overdrive.quant.real import _gemm_ok

    if _gemm_ok(lib.in_features, lib.out_features, lib.fmt) is not None:  # no cuBLAS kernel for it (_scaled_mm: x16)
        return float("inf")
    if _LIB_PASS is None:
        _LIB_PASS = torch.compile(_lib_pass, dynamic=True) if device.type == "cuda" else _lib_pass
    fn = _LIB_PASS if device.type == "cuda" else _lib_pass
    wt = lib.w_q.t()
    q_out = qs if out_kind in ("8-bit", "dual") else None
    dual = out_kind == "dual"
    if lib.fmt == "fp8":
        od = out_dtype if out_dtype != torch.float32 else torch.bfloat16
        bias = None if lib.bias is None else lib.bias.to(od)
        plain = not relu and not act and q_out is None

        def run() -> Any:
            y = torch._scaled_mm(xq, wt, scale_a=lib.x_scale, scale_b=lib.w_scale, bias=bias, out_dtype=od)
            return y if plain else fn(y, None, None, relu, act, q_out, True, dual, out_dtype)
    else:
        short = xq.shape[0] <= 16 and device.type == "cuda"  # _int_mm on CUDA needs M > 16, as Int8Linear pads
        x = torch.nn.functional.pad(xq, (0, 0, 0, 17 - xq.shape[0])) if short else xq
        scale = (lib.x_scale * lib.w_scale).float()
        bias = torch.zeros_like(scale) if lib.bias is None else lib.bias.float()

        def run() -> Any:
            return fn(torch._int_mm(x, wt), scale, bias, relu, act, q_out, False, dual, out_dtype)

    return _ms(run, device)


def _float_linear_ms(x2: torch.Tensor, lin: nn.Linear, relu: bool, act: int, device: torch.device) -> float:
    """ms of ``act(lin(x2))`` as an fp16 engine runs it: cuBLAS with its bias (+ ReLU / GELU) epilogue; SiLU as a
    pass after it."""
    from overdrive.quant.conv import ACT_GELU, ACT_SILU

    b = lin.bias if lin.bias is not None else torch.zeros(lin.out_features, device=x2.device, dtype=x2.dtype)
    wt = lin.weight.t()
    if relu or act == ACT_GELU:
        t = _ms(lambda: torch._addmm_activation(b, x2, wt, use_gelu=act == ACT_GELU), device)
    else:
        t = _ms(lambda: torch.addmm(b, x2, wt), device)
    if act == ACT_SILU:
        y = torch.addmm(b, x2, wt)
        t += _ms(lambda: torch.nn.functional.silu(y), device)
    return t


def _float_conv_ms(x: torch.Tensor, conv: nn.Conv2d, z: torch.Tensor | None, relu: bool, device: torch.device,
                   act: int = 0) -> float:
    """ms of ``relu(conv(x) (+ z))`` as an fp16 engine runs it: the faster of the two paths its conv fusion chooses
    between (:func:`conv_fusion.conv_paths_ms`), and for a 1x1 stride-1 convolution without residual also the GEMM
    with cuBLAS's bias (+ ReLU) epilogue. ``act`` (1 SiLU, 2 GELU) replaces the ReLU: the compiled path only."""
    from overdrive.engine.conv_fusion import conv_paths_ms

    w = conv.weight
    b = conv.bias if conv.bias is not None else torch.zeros(conv.out_channels, device=w.device, dtype=w.dtype)
    st, pd, dl = list(conv.stride), list(conv.padding), list(conv.dilation)
    t_fused, t_plain = conv_paths_ms(x, w, b, z, st, pd, dl, 1, relu, act)
    times = [t_plain] + ([t_fused] if t_fused is not None else [])
    if conv.kernel_size == (1, 1) and st == [1, 1] and pd == [0, 0] and z is None and not act and \
            x.is_contiguous(memory_format=torch.channels_last):
        x2, wt = x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]), w.reshape(w.shape[0], -1).t()
        times.append(_ms((lambda: torch._addmm_activation(b, x2, wt)) if relu else (lambda: torch.addmm(b, x2, wt)),
                         device))
    return min(times)


def _conv_input(m: nn.Module, shape: torch.Size, fdt: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """The seeded float input of a convolution timing (channels_last), its quantized form, and the generator (on
    ``device``: ResNet-50's batch-256 activations took 0.4-1.3 s each to draw on a 2-core CPU, and a build draws one
    per layer several times)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=g, device=device).to(fdt).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        xq = torch.ops.overdrive.quantize(x, m.x_scale, m.x_qmin, m.fmt == "fp8")
    return x, xq, g
