"""The module an engine exports: a copy of the model in the build precision, with the engine's I/O casts.

fp16/bf16 cast the whole model; int8/fp8 quantize it (calibrated, or per-token dynamic on CPU) and run its real
int8/fp8 GEMMs, the remainder in fp16 on CUDA; ``--layer-precision timed`` keeps float the layers whose
low-precision kernel loses. Backend-independent: the inductor backend exports what :func:`prepare` returns.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive.engine.config import IO_DTYPES, BuildConfig
from overdrive.engine.sources import ModelSource, by_name

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _Cast(nn.Module):
    """The engine's I/O around the compute precision: float inputs are cast to the model's dtype (they come
    in as fp32 by default, trtexec's default I/O, or as ``--inputIOFormats`` says) and go channels_last when
    4-D on CUDA; float outputs leave as ``out_dtype`` (fp32 unless ``--outputIOFormats`` says otherwise)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, channels_last: bool,
                 out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.model, self.dtype, self.channels_last, self.out_dtype = model, dtype, channels_last, out_dtype

    def forward(self, *xs: torch.Tensor) -> Any:
        ins = []
        for x in xs:
            if x.is_floating_point():
                x = x.to(self.dtype or torch.float32)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            ins.append(x)
        out = self.model(*ins)
        return _map(out, lambda t: t.to(self.out_dtype) if t.is_floating_point() else t)


def _map(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map(o, fn) for o in out)
    if isinstance(out, dict):
        return tuple(_map(v, fn) for v in out.values())  # ModelOutput / dict -> tuple in key order
    if hasattr(out, "to_tuple"):
        return tuple(_map(v, fn) for v in out.to_tuple())
    return out


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, in order: tensors, tuples/lists, and dicts (Hugging Face ModelOutput
    is one) in their key order; anything else (None, numbers) holds no tensor."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flatten_outputs(o)]
    return []


def _dynamic_int8(model: nn.Module) -> nn.Module:
    try:
        from overdrive import quant
    except ImportError as exc:
        raise OverdriveError("--int8-activations dynamic on the inductor backend needs overdrive.quant, which is not "
                             "installed in this overdrive; use --backend onnxruntime") from exc
    return quant.dynamic_int8(model)


def int8_gemms(module: nn.Module) -> dict[str, int]:
    """The int8 GEMM layers of a prepared module, by kernel: ``{"torch._int_mm": 13}`` ({} when none)."""
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import Int8Conv1x1, Int8Linear

    n = sum(isinstance(m, (Int8Linear, Int8Conv1x1)) and m.fmt == "int8" for m in module.modules())
    convs = sum(type(m) is Int8Conv2d for m in module.modules())
    return {**({"torch._int_mm": n} if n else {}), **({"overdrive::conv2d_q": convs} if convs else {})}


def lowp_layers(module: nn.Module) -> int:
    """How many layers of a prepared module run on an int8 or fp8 kernel (GEMMs, 1x1 convs as GEMMs, Triton convs).

    Example:
        >>> lowp_layers(nn.Sequential(nn.Linear(4, 4)))
        0
    """
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import Int8Conv1x1, Int8Linear

    return sum(isinstance(m, (Int8Linear, Int8Conv1x1, Int8Conv2d)) for m in module.modules())


def drop_unread_residual_quantizers(model: nn.Module) -> int:
    """Turn each ``QuantizedResidualAdd`` of a prepared int8/fp8 model into a plain add when no int8/fp8 convolution
    is left to read an 8-bit residual (the only kernel that does: its epilogue adds it); returns how many. The
    calibration puts a quantizer on every residual add (TensorRT's placement) so that a convolution can take the
    residual 8-bit; with none there (a transformer, whose residuals go to LayerNorm; every conv kept float; a CPU
    build) the quantize/dequantize round trip only costs passes and adds rounding error (a demo BERT int8 engine whose
    every GEMM stayed float had token cosine 0.9986 against the fp16 engine's 1.0000, from its int8-rounded weights
    and these round trips together).

    Example:
        >>> from overdrive.quant.real import QuantizedResidualAdd
        >>> m = nn.ModuleDict({"add": QuantizedResidualAdd(torch.tensor(4.0))})
        >>> drop_unread_residual_quantizers(m), m["add"](torch.zeros(1), torch.tensor([0.5])).item()  # not 4/127 steps
        (1, 0.5)
    """
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import QuantizedResidualAdd
    from overdrive.quant.triton_linear import Int8TritonLinear

    # a Linear on the convolution kernel reads no residual (its output is reshaped before any add)
    if any(isinstance(m, Int8Conv2d) and not isinstance(m, Int8TritonLinear) for m in model.modules()):
        return 0
    adds = [m for m in model.modules() if isinstance(m, QuantizedResidualAdd) and m.enabled]
    for m in adds:
        m.enabled = False
    return len(adds)


def _has_quantizers(model: nn.Module) -> bool:
    try:
        from overdrive import quant
    except ImportError:
        return False
    return any(True for _ in quant.quantizers(model))


def _quantize(model: nn.Module, precision: str, calib: list[tuple[torch.Tensor, ...]],
              linear_kernel: str = "cublas") -> nn.Module:
    try:
        from overdrive import quant
    except ImportError as exc:
        raise OverdriveError(f"--precision {precision} from a float model needs overdrive.quant, which is not installed "
                             "in this overdrive; build from a Q/DQ ONNX model instead, or use fp16/bf16") from exc

    dev = next((p.device for p in model.parameters()), torch.device("cpu"))

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for batch in calib:
                m(*(x.to(dev) for x in batch))

    fmts = {q.config.format for _, q in quant.quantizers(model) if q.enabled}
    if fmts and fmts != {"int8" if precision == "int8" else "fp8_e4m3"}:
        raise UsageError(f"the model is quantized already to {sorted(fmts)}, not {precision}; build it with the precision "
                         "it was quantized to, or pass the float model")
    if not any(True for _ in quant.quantizers(model)):  # a model quantized already (QAT, sparse-quantized) keeps its amax
        cfg = quant.INT8_DEFAULT if precision == "int8" else quant.FP8_DEFAULT
        model = quant.quantize(model, cfg, forward_loop, fidelity=False)  # the build checks the engine itself
    return quant.to_real(model, linear_kernel=linear_kernel)


def remainder_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """What the layers without an int8/fp8 kernel run in: fp16 on CUDA (trtexec's ``--int8 --fp16``, which
    every TensorRT int8 deployment uses: 3x3 convs, attention, norms and activations in fp32 would cost
    more than the low-precision GEMMs save), the model's own fp32 on CPU (no fast fp16 there)."""
    return torch.float16 if precision in ("int8", "fp8") and device.type == "cuda" else None


def cast_float_remainder(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every float parameter and buffer to ``dtype`` except those of the real int8/fp8 GEMM modules
    (their int8/fp8 weights and fp32 scales stay as calibrated). In place; returns ``model``.

    Example:
        >>> # cast_float_remainder(quant.to_real(calibrated), torch.float16)
    """
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import QuantizedResidualAdd, _LowPrecisionGemm

    low = (_LowPrecisionGemm, Int8Conv2d, QuantizedResidualAdd)
    keep = {id(t) for m in model.modules() if isinstance(m, low)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    for m in model.modules():
        if isinstance(m, low):
            continue
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in keep and p.is_floating_point() and p.dtype != dtype and p.element_size() > 1:
                p.data = p.data.to(dtype)
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and id(b) not in keep and b.is_floating_point() and b.element_size() > 1:
                m._buffers[name] = b.to(dtype)
    return model


def layer_placement(model: nn.Module, float_dtype: torch.dtype | None) -> dict[str, str]:
    """Where each quantized layer of a prepared int8/fp8 model runs: its low-precision kernel, or the float dtype
    and why (no kernel for that layer, or timed faster in float). From ``quant.to_real``'s report and the layer
    timing's verdicts; ``engine.info["layers"]``.

    Example:
        >>> import torch.nn as nn
        >>> from overdrive.quant.real import Int8Linear
        >>> m = nn.Sequential(Int8Linear.dynamic(nn.Linear(16, 16)), nn.Conv2d(3, 3, 3))
        >>> m._overdrive_real = {"0": "int8 dynamic (per-token)", "1": "Conv2d (3, 3) has no low-precision kernel"}
        >>> layer_placement(m, None)["0"]
        'int8 GEMM, per-token scales (torch._int_mm)'
    """
    from overdrive.quant.conv import Int8Conv2d
    from overdrive.quant.real import Int8Conv1x1, Int8Linear
    from overdrive.quant.triton_linear import Int8TritonLinear

    real = getattr(model, "_overdrive_real", None) or {}
    kept = getattr(model, "_overdrive_kept_float", None) or {}
    timed = getattr(model, "_overdrive_layer_verdicts", None) or {}  # the build's timing of each layer kept low
    fdt = str(float_dtype or torch.float32).removeprefix("torch.")
    out: dict[str, str] = {}
    for name, what in real.items():
        if name in kept:
            out[name] = f"{fdt}: timed faster than its low-precision kernel ({kept[name]})"
            continue
        try:
            m = model.get_submodule(name) if name else model
        except AttributeError:  # not in this module tree (a wrapper's report): say what the conversion said
            out[name] = what
            continue
        fmt = getattr(m, "fmt", None)
        if isinstance(m, Int8TritonLinear):
            out[name] = f"{fmt} GEMM, Triton (overdrive::conv2d_q on the 1x1 view, epilogue fused)"
        elif isinstance(m, Int8Conv2d):
            out[name] = f"{fmt} conv, Triton implicit GEMM (overdrive::conv2d_q)"
        elif isinstance(m, (Int8Linear, Int8Conv1x1)):
            mm = "torch._int_mm" if fmt == "int8" else "torch._scaled_mm"
            kind = "1x1 conv as a GEMM" if isinstance(m, Int8Conv1x1) else "GEMM"
            scales = ", per-token scales" if getattr(m, "rowwise", False) else ""
            out[name] = f"{fmt} {kind}{scales} ({mm})"
        else:
            out[name] = f"{fdt}: {what}"
            continue
        if name in timed:  # how it timed against float, as TensorRT's verbose log shows the tactic it chose
            out[name] += f", timed {timed[name]}"
    return out


def prepare(src: ModelSource, cfg: BuildConfig, device: torch.device,
            calib: list[tuple[torch.Tensor, ...]], timings: dict[str, Any] | None = None) -> nn.Module:
    """The module to export: a copy of the model in the build precision on ``device``. ``timings``: the layer
    timings of a ``--timing-cache`` (reused, and extended with what this build measures)."""
    model = copy.deepcopy(src.module) if src.module is not None else src.as_module()
    if src.module is not None:  # called by its input names (GPT-2's second parameter is its cache, not the mask)
        model = by_name(model, src.input_names)
    model = model.eval().to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    dtype = _HALF.get(cfg.precision)
    phases: dict[str, float] = {}  # seconds of the slow build steps (backend_meta["build_phases_s"])
    calibrated_here = False
    if cfg.precision in ("int8", "fp8"):
        if src.onnx_bytes is None and cfg.int8_activations == "dynamic":  # per-token scales, no calibration
            model = _dynamic_int8(model)
        elif src.onnx_bytes is None:  # a Q/DQ ONNX model is quantized already (its Q/DQ graph runs as imported)
            t0 = time.perf_counter()
            calibrated_here = not _has_quantizers(model)  # ours to place (a model quantized already keeps its own)
            # timed builds on CUDA put Linear layers on the convolution kernel too (its epilogue takes the GELU and the
            # next quantize); the timing then keeps each on that kernel, on cuBLAS's GEMM or in float, the fastest
            triton_linears = device.type == "cuda" and cfg.layer_precision == "timed" and cfg.lowp_linears == "timed"
            model = _quantize(model, cfg.precision, calib, "triton" if triton_linears else "cublas")
            phases["calibrate"] = time.perf_counter() - t0
            dtype = remainder_dtype(cfg.precision, device)
            if dtype is not None:
                model = cast_float_remainder(model, dtype)
        if src.onnx_bytes is None and cfg.layer_precision == "timed":  # a layer whose int8/fp8 GEMM loses stays float
            from overdrive.engine.layer_choice import conv_plan, keep_float_where_faster

            x = tuple(t.to(device) for t in calib[0])
            x = tuple(t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in x)
            # each int8/fp8 convolution is timed in the form the engine's fusion pass gives it (engine/README.md)
            t0 = time.perf_counter()
            plan = conv_plan(model, x, cfg.quantize_residuals)
            model, kept = keep_float_where_faster(model, x, device, dtype, plan=plan, timings=timings,
                                                  replan=lambda mdl: conv_plan(mdl, x, cfg.quantize_residuals),
                                                  groups=cfg.groups_lowp_siblings(device.type))
            phases["layer_timing"] = time.perf_counter() - t0
            phases.update({f"layer_timing.{k}": v for k, v in getattr(model, "_overdrive_layer_timing_s", {}).items()})
            model._overdrive_kept_float = kept
        if src.onnx_bytes is None and cfg.int8_activations != "dynamic" and calibrated_here:
            model._overdrive_residuals_dropped = drop_unread_residual_quantizers(model)
        if src.onnx_bytes is None:
            model._overdrive_layers = layer_placement(model, dtype)
    elif dtype is not None:
        model = model.to(dtype)
    cl = cfg.channels_last and device.type == "cuda"
    if cl:
        model = model.to(memory_format=torch.channels_last)
    out_dtype = getattr(torch, IO_DTYPES[cfg.output_io_formats[0].split(":")[0]]) if cfg.output_io_formats else torch.float32
    if not out_dtype.is_floating_point:
        raise UsageError(f"--outputIOFormats {cfg.output_io_formats[0]}: the engine's outputs are floating point here; "
                         "give fp32, fp16 or bf16")
    if phases:
        model._overdrive_phases = phases
    return _Cast(model, dtype, cl, out_dtype).eval()
