"""ONNX export with QuantizeLinear/DequantizeLinear pairs where TensorRT wants them.

Placement follows TensorRT's rules: Q/DQ on the inputs (activation and weight) of Conv,
ConvTranspose and Gemm/MatMul, never on their outputs, plus Q/DQ on the residual input of an add
(``QuantAdd``) so the add fuses into the preceding conv, and on both inputs of attention's
activation-by-activation MatMuls (``QuantMatmul``, ``QuantSDPA``; opt-in). Scales are symmetric (zero point 0),
weights per output channel (``axis``, hence opset >= 13). int8 uses the TorchScript exporter's
fake-quantize translation; fp8 e4m3 emits Q/DQ with a float8 zero point (opset >= 19).

Example:
    >>> # path = quant.export_onnx(model, (torch.randn(1, 1, 8, 8),), "model_int8.onnx")
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.optional import require
from overdrive.quant.api import eval_mode, quantizers


def _check_ready(model: nn.Module) -> str:
    qs = [(n, q) for n, q in quantizers(model) if q.enabled]
    if not qs:
        raise UsageError("the model has no enabled quantizers; call quant.quantize(model, config, forward_loop) first")
    missing = [n for n, q in qs if not q.is_calibrated]
    if missing:
        raise UsageError(f"cannot export before calibration: quantizer(s) {missing[:5]} have no amax; run "
                         "quant.quantize(model, config, forward_loop=...) or quant.calibrate(model, forward_loop)")
    formats = {q.config.format for _, q in qs}
    return "fp8_e4m3" if "fp8_e4m3" in formats else "int8"


def _max_opset() -> int | None:
    """The newest opset this torch's exporter accepts (None when torch does not say)."""
    try:
        from torch.onnx import _constants
    except ImportError:
        return None
    return getattr(_constants, "ONNX_MAX_OPSET", None)


def check_opset(opset: int | None, fmt: str) -> int:
    """The opset to export ``fmt`` ('int8' / 'fp8_e4m3') with: ``opset``, or 17 (int8) / 19 (fp8) when None.

    Raises UsageError for an opset that cannot express the Q/DQ nodes or that torch cannot write,
    so the CLI can refuse it before calibrating."""
    opset = opset or (19 if fmt == "fp8_e4m3" else 17)
    if opset < 13:
        raise UsageError(f"opset {opset} is too old: per-channel QuantizeLinear needs opset >= 13")
    if fmt == "fp8_e4m3" and opset < 19:
        raise UsageError(f"opset {opset} cannot express fp8 QuantizeLinear; use opset >= 19 for fp8 models")
    top = _max_opset()
    if top is not None and opset > top:
        raise UsageError(f"opset {opset} is newer than torch {torch.__version__}'s ONNX exporter writes (at most "
                         f"{top}); use an opset from {19 if fmt == 'fp8_e4m3' else 13} to {top}")
    return opset


def find_op_owner(model: nn.Module, example_inputs: tuple[Any, ...], op: str) -> str | None:
    """The name of the innermost module whose forward calls aten ``op`` (for error messages)."""
    from torch.overrides import TorchFunctionMode

    stack: list[str] = []
    found: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    class _Watch(TorchFunctionMode):  # sees torch.* calls (torch.fft.fft is named 'fft_fft' there)
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            fname = getattr(func, "__name__", "")
            if not found and fname and (fname == op or fname.strip("_") == op.strip("_")):
                found.append(stack[-1] if stack else "<root>")
            return func(*args, **(kwargs or {}))

    def enter(m: nn.Module, inputs: Any) -> None:
        if m in names:
            stack.append(names[m])

    def leave(m: nn.Module, inputs: Any, output: Any) -> None:  # must return None: a value replaces the output
        if m in names and stack:
            stack.pop()

    handles = [h for m in names for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.no_grad(), _Watch():
            model(*example_inputs)
    except Exception:  # noqa: BLE001 - best effort: only used to improve an error message
        pass
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def export_onnx(model: nn.Module, example_inputs: tuple[Any, ...] | torch.Tensor, path: str | Path, opset: int | None = None,
                input_names: tuple[str, ...] = ("input",), output_names: tuple[str, ...] = ("output",),
                dynamic_batch: bool = True, check: bool = True) -> Path:
    """Export a calibrated fake-quant model to ONNX with Q/DQ nodes; returns the path.

    ``opset`` defaults to 17 (int8) or 19 (fp8, the first opset with float8 Q/DQ). The model is
    exported in eval mode on its current device; ``onnx.checker`` runs when ``check``.

    Example:
        >>> # quant.export_onnx(model, (torch.randn(1, 3, 224, 224),), "resnet50_int8.onnx")
    """
    onnx = require("onnx", extra="onnx", feature="ONNX export")
    fmt = _check_ready(model)
    opset = check_opset(opset, fmt)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dyn = {n: {0: "batch"} for n in (*input_names, *output_names)} if dynamic_batch else None
    try:
        with eval_mode(model), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, tuple(example_inputs), str(path), opset_version=opset, dynamo=False,
                              input_names=list(input_names), output_names=list(output_names), dynamic_axes=dyn,
                              do_constant_folding=True)
    except Exception as exc:  # noqa: BLE001 - turn exporter failures into a message naming op and module
        msg = str(exc)
        m = re.search(r"aten::(\w+)", msg) or re.search(r"operator '?(\w+)'?", msg)
        if m is None:
            raise OverdriveError(f"ONNX export failed: {msg.splitlines()[0] if msg else type(exc).__name__}") from exc
        op = m.group(1)
        with eval_mode(model):  # as exported: no dropout, no BatchNorm statistics updates
            owner = find_op_owner(model, tuple(example_inputs), op)
        raise OverdriveError(
            f"ONNX (opset {opset}) cannot express op '{op}' used in module '{owner or '?'}': "
            f"{msg.splitlines()[0][:300]}; replace that op, keep the module out of the export, or try another opset"
        ) from exc
    if check:
        onnx.checker.check_model(onnx.load(str(path)))
    return path


def qdq_counts(path: str | Path) -> dict[str, int]:
    """How many of each op type the exported graph has (tests and the CLI print this)."""
    onnx = require("onnx", extra="onnx", feature="ONNX inspection")
    counts: dict[str, int] = {}
    for node in onnx.load(str(path)).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
