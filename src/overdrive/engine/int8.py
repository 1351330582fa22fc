"""Where an int8 engine's activation scales come from, and what of it runs as integer kernels.

Two modes (``BuildConfig.int8_activations``, ``overdrive build --int8-activations``):

- ``static``: one scale per activation tensor, calibrated on ``calib`` batches (Q/DQ; today's trtexec ``--int8
  --calib``). Without calibration data the ranges come from the example (random) inputs: fit for timing only.
- ``dynamic``: one scale per token (row) computed from each input at run time, weights int8 per output channel;
  no calibration. CPU only: ONNX Runtime's ``quantize_dynamic`` (onnxruntime backend) or per-row ``torch._int_mm``
  (inductor backend, built from a PyTorch model). Only the weight GEMMs (Linear / MatMul / Gemm) become int8;
  convolutions and attention's activation x activation MatMuls stay float.

``None`` (auto) picks dynamic for a float PyTorch model on CPU whose backend can build it and whose int8 work is
GEMMs (it has Linear layers and no convolutions, which dynamic int8 would leave float), else static. With
calibration data a dynamic build from a PyTorch model on the inductor backend first applies SmoothQuant (alpha 0.5)
from it (``quant.smoothed_float``): on the pretrained all-MiniLM-L6-v2 per-token int8 after SmoothQuant kept cosine
0.999 / kNN@10 0.963 to fp32, where static int8 kept 0.981 / 0.848 and dynamic alone 0.997 / 0.947
(``benchmarks/results/quant_pretrained.md``). Not on the onnxruntime backend: its dynamic MatMuls take one scale
per tensor, and there the smoothing measured no better (kNN@10 0.896 against 0.911,
``benchmarks/results/transformer_engines_cpu_minilm_sq_bug.md``), so calibration data means static there.

Example:
    >>> summary({"activations": "dynamic", "why": "asked for", "ops": {"MatMulIntegerToFloat": 6, "DynamicQuantizeMatMul": 7}})
    'int8 activations dynamic (per-token scales at run time, int8 weights per channel; asked for): 13 integer kernel(s): DynamicQuantizeMatMul 7, MatMulIntegerToFloat 6'
"""

from __future__ import annotations

from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.sources import ModelSource

_WHAT = {"static": "per-tensor scales calibrated at build", "dynamic": "per-token scales at run time, int8 weights per channel"}


def is_quantized(src: ModelSource) -> bool:
    """Whether ``src`` carries its own int8/fp8 scales: a Q/DQ ONNX model, or a module with overdrive.quant quantizers."""
    if src.onnx_bytes is not None:
        from overdrive.engine.backends.onnxruntime import has_qdq

        return has_qdq(src.onnx_bytes)
    try:
        from overdrive import quant
    except ImportError:
        return False
    return src.module is not None and any(True for _ in quant.quantizers(src.module))


def gemm_model(src: ModelSource) -> bool:
    """Whether the model's quantizable layers are GEMMs only: Linear or transformers' Conv1D (or a weight MatMul /
    Gemm in ONNX), no convolution."""
    kinds = _layer_kinds(src)
    return "gemm" in kinds and "conv" not in kinds


def _layer_kinds(src: ModelSource) -> set[str]:
    """Which quantizable layers ``src`` has: ``"gemm"`` (Linear, transformers' Conv1D, a weight MatMul / Gemm in
    ONNX) and ``"conv"`` (a convolution).

    Example:
        >>> _layer_kinds(ModelSource(module=torch.nn.Sequential(torch.nn.Linear(4, 4)), input_names=["x"]))
        {'gemm'}
    """
    if src.onnx_bytes is not None:
        import onnx

        from overdrive.engine.onnx import quantizable_nodes

        model = onnx.load_from_string(src.onnx_bytes)
        chosen = set(quantizable_nodes(model))  # names unnamed nodes in place: read the op types after it
        ops = {n.op_type for n in model.graph.node if n.name in chosen}
        return ({"gemm"} if ops & {"MatMul", "Gemm"} else set()) | ({"conv"} if ops & {"Conv", "ConvTranspose"} else set())
    if src.module is None:
        return set()
    mods = list(src.module.modules())
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
            torch.nn.ConvTranspose3d)
    from overdrive._utils.optional import hf_conv1d_class

    gemm = (torch.nn.Linear,) + tuple(c for c in (hf_conv1d_class(),) if c is not None)  # GPT-2's Conv1D: a Linear
    return ({"gemm"} if any(isinstance(m, gemm) for m in mods) else set()) | \
        ({"conv"} if any(isinstance(m, conv) for m in mods) else set())


def _no_dynamic_reason(src: ModelSource) -> str:
    """Why an auto int8 build without calibration data stays static, in terms of the model's own layers."""
    if "conv" in _layer_kinds(src):
        return "the model has convolutions, which dynamic int8 leaves float"
    what = "weight MatMul / Gemm nodes" if src.onnx_bytes is not None else "Linear layers"
    return f"the model has no {what}, the only layers dynamic int8 makes integer"


def resolve(requested: str | None, backend: Any, device: torch.device, src: ModelSource,
            calib: list[tuple[torch.Tensor, ...]] | None) -> tuple[str, str]:
    """The activation mode of an int8 build, ``("static" | "dynamic", why)``; a UsageError for a dynamic build
    that cannot be made (a quantized model, CUDA, a backend or source without it)."""
    quantized = is_quantized(src)
    unavailable = getattr(backend, "int8_dynamic_unavailable", None)
    why_not = unavailable(src, device) if unavailable else f"the {backend.NAME} backend has no dynamic int8"
    if requested == "dynamic":
        if quantized:
            raise UsageError("--int8-activations dynamic: the model is quantized already (Q/DQ nodes or overdrive.quant "
                             "quantizers), so its activation scales are static; build it without the flag, or build "
                             "dynamic int8 from the float model")
        if why_not:
            raise UsageError(f"--int8-activations dynamic: {why_not}")
        return "dynamic", "asked for"
    if requested == "static":
        return "static", "asked for"
    if quantized:
        return "static", "auto: the model is quantized already (its calibrated scales)"
    gemms = why_not is None and gemm_model(src)
    if gemms and not calib:
        return "dynamic", "auto: no calibration data (--calib), and dynamic scales need none"
    if gemms and smoothquant_applies(backend.NAME, src, calib):
        return "dynamic", ("auto: a GEMM-only model (Linear layers, no convolutions): dynamic scales after "
                           "SmoothQuant from the calibration data, more accurate than static int8")
    if calib:
        where = "" if not gemms else " to an ONNX model (SmoothQuant for dynamic int8 needs the PyTorch model)" \
            if src.module is None else f" on the {backend.NAME} backend (dynamic int8 after SmoothQuant is built on " \
            "the inductor backend)"
        return "static", "auto: calibration data given (--calib)" + where
    return "static", "auto: " + (why_not or _no_dynamic_reason(src))


def summary(record: dict[str, Any]) -> str:
    """One line for ``overdrive build`` from ``engine.info["int8"]``: the mode, why, and the integer kernels."""
    mode = record["activations"]
    head = f"int8 activations {mode} ({_WHAT.get(mode, mode)}; {record.get('why', '')})"
    if record.get("smoothquant"):
        head += f", SmoothQuant {record['smoothquant']}"
    ops = record.get("ops")
    if ops is None:
        return head
    kept = record.get("kept_float") or {}
    tail = (f"; {len(kept)} layer(s) kept float, timed faster than their int8 GEMM (engine.info['layers_kept_float'])"
            if kept else "")
    layout = record.get("layout")
    if layout:  # the onnxruntime backend's Q/DQ layout, chosen by timing at build
        tail += f"; {layout['chosen']} Q/DQ layout" + (f" ({layout['why']})" if layout.get("why") else "")
    if record.get("float_convs") and ops:
        n = record["float_convs"]
        tail += (f"; {n} convolution(s) stay float (ONNX Runtime fused no integer kernel for them)"
                 if (layout or {}).get("chosen") == "integer" else
                 f"; {n} convolution(s) run in float behind DequantizeLinear (ONNX Runtime has no integer convolution "
                 "with a float output; built from the float model with --calib, the build can choose its integer "
                 "layout)")
    if not ops:
        return head + (": no integer kernels, the int8 graph computes in float here (dequantize + fp32: no int8 "
                       "speedup; backend_meta says why)") + tail
    listed = ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))
    return f"{head}: {sum(ops.values())} integer kernel(s): {listed}{tail}"


def smoothquant_applies(backend: str, src: ModelSource, calib: list[tuple[torch.Tensor, ...]] | None) -> bool:
    """Whether a dynamic int8 build smooths first (:func:`smoothed_source`): calibration data, a PyTorch model, and
    the inductor backend (onnxruntime's dynamic MatMuls take one scale per tensor; smoothing measured no better).

    Example:
        >>> smoothquant_applies("onnxruntime", None, [(torch.zeros(1),)])
        False
    """
    return bool(calib) and backend == "inductor" and src.module is not None


def smoothed_source(src: ModelSource, calib: list[tuple[torch.Tensor, ...]]) -> tuple[ModelSource, int]:
    """``src`` with its PyTorch model replaced by the SmoothQuant-smoothed float copy (alpha 0.5, factors from the
    activations ``calib`` produces; ``quant.smoothed_float``), and the number of Linear layers smoothed: what a
    dynamic int8 build with calibration data quantizes. The same function as the model, up to fp32 rounding.

    Example:
        >>> # src, n = smoothed_source(from_module(bert, ["input_ids", "attention_mask"]), calib_batches)
    """
    from dataclasses import replace

    from overdrive import quant
    from overdrive.engine.sources import by_name

    names = list(src.input_names)

    def forward_loop(m: torch.nn.Module) -> None:
        run = by_name(m, names)
        with torch.no_grad():
            for batch in calib:
                run(*batch)
    smoothed = quant.smoothed_float(src.module, forward_loop)
    return replace(src, module=smoothed), len(smoothed._overdrive_smoothed)
