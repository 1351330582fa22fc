"""The whole-engine check of an int8/fp8 CUDA build: the engine timed against its float twin, the faster kept.

The per-layer timing (``engine/layer_choice.py``) judges each layer alone; what the compiler fuses around the layers
in the whole program is in no single layer's timing. After it, :func:`whole_engine_choice` compiles the model's float
build beside the int8/fp8 engine, times the two in interleaved rounds and keeps the int8/fp8 one only where it wins by
:data:`WHOLE_ENGINE_MARGIN`, as a TensorRT int8 build, whose search includes its fp16 tactics, cannot come out slower
than them. A build left with no low-precision layer at all is the float build directly (:func:`all_float_build`).
``backends/inductor.py: build`` calls both.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from overdrive.engine.backends.prepare import (_Cast, drop_unread_residual_quantizers, lowp_layers, prepare,
                                               remainder_dtype)
from overdrive.engine.config import BuildConfig
from overdrive.engine.kernel_timing import paired_ms
from overdrive.engine.sources import ModelSource, save_exported

# The int8/fp8 engine is kept only when it runs at least this much faster than its float twin as a whole (float ms /
# low-precision ms): within it the two are as fast as paired timing can tell (the same program built twice differed
# by 1-2% in the GPU demo of 2026-12-05), and the float build computes with the model's own weights.
WHOLE_ENGINE_MARGIN = 1.02


def whole_engine_timed(cfg: BuildConfig, device: torch.device) -> bool:
    """Whether an int8/fp8 build times its whole engine against its float twin (:func:`_float_twin_module`) and
    keeps the faster: ``layer_precision="timed"`` on CUDA. A dynamic
    profile is timed at its example (opt) shape, as the per-layer timing is. The per-layer timing judges each
    convolution in the form its neighbours leave it, but not what the compiler then fuses around them: a ResNet-50
    int8 engine whose timing kept 14 int8 convolutions ran 0.94x its fp16 engine (``engine_zoo_cnn_replan.md``).
    TensorRT's int8 builds cannot come out slower than their fp16 tactics, which are in their search; this check
    gives the same guarantee. It costs one more compile (10-20 s for a ResNet-50).

    Example:
        >>> cfg = BuildConfig(precision="int8")
        >>> whole_engine_timed(cfg, torch.device("cuda")), whole_engine_timed(cfg, torch.device("cpu"))
        (True, False)
        >>> whole_engine_timed(cfg.replace(layer_precision="all"), torch.device("cuda"))
        False
    """
    return cfg.precision in ("int8", "fp8") and cfg.layer_precision == "timed" and device.type == "cuda"



def _float_cfg(cfg: BuildConfig, dtype: torch.dtype) -> BuildConfig:
    """``cfg`` for the float build in ``dtype`` of the same model (an int8/fp8 build's float twin)."""
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
    return cfg.replace(precision=name, int8_activations=None, quantize_residuals=False)


def _float_twin_module(module: nn.Module, src: ModelSource, cfg: BuildConfig, device: torch.device,
                       example: tuple[torch.Tensor, ...]) -> tuple[nn.Module, list[str], str]:
    """The engine an int8/fp8 build is timed against as a whole (:func:`whole_engine_timed`): its module, the
    low-precision layers it runs in float, and what its weights are.

    From a float model (calibrated by this build), it is the float build of that model, prepared exactly as an
    fp16 (CUDA; fp32 on CPU) engine of it is, so it runs as fast as that engine and computes with the model's own
    weights, as a TensorRT int8 build does in the layers where its fp16 tactics win. A model quantized already (QAT,
    a sparse-quantized one) is its own reference: each low-precision layer is replaced by a float layer holding its
    dequantized weights (:func:`layer_choice.float_everywhere`), and its quantizers elsewhere stay."""
    from overdrive.engine.backends.prepare import _has_quantizers
    from overdrive.engine.layer_choice import float_everywhere, lowp_layer_names

    fdt = remainder_dtype(cfg.precision, device) or torch.float32
    low = module.model
    if src.module is not None and not _has_quantizers(src.module):
        swapped = lowp_layer_names(low)
        twin = prepare(src, _float_cfg(cfg, fdt), device, [example])
        twin.model._overdrive_layers = dict(getattr(low, "_overdrive_layers", None) or {})
        twin.model._overdrive_kept_float = dict(getattr(low, "_overdrive_kept_float", None) or {})
        return twin, swapped, "the float model's own weights"
    inner, names = float_everywhere(low, fdt)
    if getattr(inner, "_overdrive_residuals_dropped", None) is not None:  # quantizers the build placed (not QAT's)
        # no int8/fp8 convolution is left to read an 8-bit residual
        inner._overdrive_residuals_dropped += drop_unread_residual_quantizers(inner)
    return _Cast(inner, module.dtype, module.channels_last, module.out_dtype).eval(), names, "dequantized weights"


def all_float_build(module: nn.Module, src: ModelSource, cfg: BuildConfig, device: torch.device,
                     example: tuple[torch.Tensor, ...]) -> nn.Module | None:
    """The float build of the model when an int8/fp8 build of a float model is left with no low-precision layer by the
    per-layer timing (CUDA, ``layer_precision="timed"``), as the whole-engine timing's float twin is
    (:func:`_float_twin_module`): the model's own weights, and the float engine's passes. None otherwise (a layer
    kept low precision, a model quantized already, a CPU build: those keep the dequantized float layers)."""
    from overdrive.engine.backends.prepare import _has_quantizers

    if not whole_engine_timed(cfg, device) or src.onnx_bytes is not None or src.module is None:
        return None
    if lowp_layers(module) or _has_quantizers(src.module):
        return None
    twin, _, _ = _float_twin_module(module, src, cfg, device, example)
    twin.model._overdrive_phases = dict(getattr(module.model, "_overdrive_phases", {}))
    return twin


def whole_engine_choice(module: nn.Module, ep: Any, runner: Any, example: tuple[torch.Tensor, ...],
                         cfg: BuildConfig, device: torch.device, src: ModelSource, mode: str, freezing: bool,
                         fp32: dict[str, str], graph: bool, meta: dict[str, Any], sections: dict[str, bytes],
                         dyn: Any = None) -> tuple[Any, Any]:
    """Time the int8/fp8 engine against its float twin (:func:`_float_twin_module`: the float build of the same
    model, so no less accurate) and keep the faster (:func:`whole_engine_timed`). ``meta`` and ``sections`` are
    updated in place when the float one wins; ``meta["whole_engine"]`` records both times either way."""
    from overdrive.engine.backends.inductor import _export, _fuse, _lowp_meta, _runner  # the build's own steps

    t0 = time.perf_counter()
    fdt = remainder_dtype(cfg.precision, device) or torch.float32
    twin, swapped, weights = _float_twin_module(module, src, cfg, device, example)
    ep_f = _export(twin, example, cfg, src, dyn, fp32)
    # the float build's passes (an fp16 engine's cuDNN conv+ReLU fusions, GEMM+GELU, sibling GEMMs)
    fused = _fuse(ep_f, example, _float_cfg(cfg, fdt), device, src, dyn is not None)
    runner_f, _ = _runner(ep_f, cfg, device, mode, dyn is not None, freezing, fp32, graph, example)
    with torch.no_grad():
        low_ms, float_ms = paired_ms(lambda: runner(*example), lambda: runner_f(*example), device)
    name = str(fdt).removeprefix("torch.")
    keep_float = float_ms < low_ms * WHOLE_ENGINE_MARGIN  # a tie goes to the float build: as fast, more accurate
    meta["whole_engine"] = {"lowp_ms": round(low_ms, 4), "float_ms": round(float_ms, 4),
                            "kept": name if keep_float else cfg.precision, "float_weights": weights,
                            "why": f"{cfg.precision} {float_ms / low_ms:.2f}x {name} as a whole engine "
                                   f"({low_ms:.3f} ms against {float_ms:.3f} ms)"}
    meta["build_phases_s"]["whole_engine_timing"] = round(time.perf_counter() - t0, 2)
    if not keep_float:
        return ep, runner
    why = meta["whole_engine"]["why"]
    inner = twin.model
    inner._overdrive_kept_float = {**(getattr(inner, "_overdrive_kept_float", None) or {}),
                                   **{n: why for n in swapped}}
    inner._overdrive_layers = {**(getattr(inner, "_overdrive_layers", None) or {}),
                               **{n: f"{name}: timed faster than its low-precision kernel ({why})" for n in swapped}}
    meta.update(fused)
    meta.update(_lowp_meta(twin, cfg, device, src))
    sections["exported_program"] = save_exported(ep_f)
    return ep_f, runner_f
