"""Sparse-quantized models: 2:4 pruning followed by overdrive.quant (int8 / fp8 fake-quant, QAT, ONNX).

Quantizers are symmetric (zero point 0), so a pruned zero quantizes to exactly zero at any amax,
per tensor or per channel: the (fake-)quantized weights keep the 2:4 pattern. ``quant.quantize``
swaps Linear/Conv for QuantLinear/QuantConv objects that share the pruned layer's Parameters and
buffers (masks included); :func:`sparse_quantize` re-points the sparsity handle at the swapped
layers and checks the quantized weights. Fine-tune with masks held through QAT by passing
``attach=handle.attach`` to :func:`overdrive.quant.qat`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from overdrive import quant, sparsity
    >>> model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    >>> handle = sparsity.sparsify(model)
    >>> model = sparse_quantize(handle, quant.INT8_DEFAULT, lambda m: m(torch.randn(64, 32)))
    >>> type(model[0]).__name__, sparsity.is_2to4(model[0].weight_quantizer(model[0].weight))
    ('QuantLinear', True)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity.handle import SparseHandle


def sparse_quantize(handle: SparseHandle, config: Any, forward_loop: Callable[[nn.Module], Any] | None) -> nn.Module:
    """Quantize the pruned model of ``handle`` with ``overdrive.quant.quantize(model, config, forward_loop)``,
    re-point the handle at the quantized layers and verify that every (fake-)quantized weight keeps
    the 2:4 pattern. Returns the quantized model (use it instead of the float one: a model that adds
    tensors in its own forward comes back as a new object of a subclass of its class).

    Example:
        >>> # model = sparsity.sparse_quantize(handle, quant.INT8_DEFAULT, lambda m: [m(x) for x in calib])
    """
    from overdrive import quant

    if not isinstance(handle, SparseHandle):
        raise UsageError(f"sparse_quantize expects the SparseHandle returned by sparsity.sparsify, got "
                         f"{type(handle).__name__}")
    model = quant.quantize(handle.model, config, forward_loop)
    handle.rebind(model)
    unquantized = [layer.name for layer in handle.layers if not hasattr(layer.module, "weight_quantizer")]
    handle.verify()
    if len(unquantized) == len(handle.layers):
        raise UsageError(f"quant config selected none of the pruned layers ({unquantized[:3]}...); "
                         "check its include/exclude patterns and layer_types")
    return model


def onnx_weight_sparsity(path: str | Path, handle: SparseHandle | None = None) -> list[dict[str, Any]]:
    """Weight initializers of an ONNX file (2-D and higher) with whether each is 2:4 along its input
    dimension (Gemm weights (out, in) and Conv weights (O, I, *k), grouped as sparsity.masks does).
    With ``handle``, only the pruned layers' weights, in handle order. A weight the file does not hold by name is
    found by value: ``torch.onnx.export``'s constant folding (its default, both exporters) stores a Linear's weight
    transposed, (in, out), under a generated name (``onnx::MatMul_12``, ``val_37``); a file whose weights were folded
    to their quantized integer (or fp8) codes, as ONNX Runtime's optimizer writes them for its integer kernels
    (``MatMulIntegerToFloat``, ``ConvInteger``), is matched by those codes against the layer's weight quantizer
    (within one step, for ties rounded the other way) and checked on the codes themselves. A pruned weight found
    none of these ways (changed by the export, or by training after it) is an error.

    Example:
        >>> # rows = sparsity.onnx_weight_sparsity("digits_int8.onnx", handle); all(r["is_2to4"] for r in rows)
    """
    import torch

    from overdrive._utils.optional import require
    from overdrive.sparsity.masks import is_2to4

    onnx = require("onnx", extra="onnx", feature="checking ONNX weights")
    from onnx import numpy_helper

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"ONNX file {str(path)!r} does not exist")
    graph = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    stored_in_out = _matmul_b_weights(graph)  # (in, out) as a MatMul's second input (through its Q/DQ pair)
    names = {n: n for n, a in inits.items() if a.ndim >= 2}  # row name -> initializer name
    if handle is not None:
        # A model exported by keyword (export_onnx wraps it in _utils.inputs.ByName whenever its forward takes the
        # input names, nn.Sequential's `input` included) has its weights under the wrapper's `module.` prefix.
        names = {layer.name: next((k for k in (layer.name, f"module.{layer.name}") if k in inits), "")
                 for layer in handle.layers}
        found = _by_value(inits, [layer for layer in handle.layers if not names[layer.name]], set(names.values()))
        names.update({n: k for n, (k, _) in found.items()})
        missing = [n for n, k in names.items() if not k]
        if missing:
            raise UsageError(f"{path.name} holds no initializer named {missing[:3]}, nor one equal to their weights "
                             "(or transposed): export the model as it is now, without folding the weights into other "
                             "constants (overdrive.quant.export_onnx keeps them by name; torch.onnx.export(..., "
                             "dynamo=False, do_constant_folding=False) too)")
    transposed = {layer.name for layer in handle.layers if layer.transposed} if handle is not None else set()
    folded = {n: flipped for n, (_, flipped) in found.items()} if handle is not None else {}
    rows = []
    for n, k in names.items():
        w = torch.from_numpy(inits[k].astype("float32"))
        if n in folded:  # found by value: its orientation is known (flipped: stored (in, out))
            t = folded[n]
        else:
            # a MatMul-B weight is (in, out), as is a Conv1D's
            t = k in stored_in_out if k in stored_in_out or stored_in_out else n in transposed
        rows.append({"name": n, "shape": list(w.shape), "nonzero_fraction": float((w != 0).float().mean()),
                     "is_2to4": is_2to4(w.t() if t and w.dim() == 2 else w)})
    return rows


def _by_value(inits: dict[str, Any], layers: list[Any], taken: set[str]) -> dict[str, tuple[str, bool]]:
    """For each pruned layer, the initializer equal to its weight's GEMM view (out, in, ...) or, for a 2-D one, to
    its transpose (in, out): ``{layer name: (initializer name, transposed)}``. Unnamed matches only (an exporter's
    folded constants); a layer matching none is left out."""
    import numpy as np

    out: dict[str, tuple[str, bool]] = {}
    for layer in layers:
        w = layer.as_gemm(layer.weight).detach().float().cpu().numpy()  # (out, in, *k)
        quantized = _quantized_views(layer)  # (fake-quantized weight, its integer / fp8 codes), or None
        for k, a in inits.items():
            if k in taken:
                continue
            hit = next((flip for flip in (False, True) if (not flip or a.ndim == 2) and _same_weight(
                a.T if flip else a, w, quantized)), None)
            if hit is not None:
                out[layer.name] = (k, hit)
                taken.add(k)
                break
    return out


def _quantized_views(layer: Any) -> tuple[Any, Any] | None:
    """The layer's weight as its enabled, calibrated weight quantizer sees it, as GEMM views (out, in, *k): the
    fake-quantized weight and its codes (fake-quantized / scale: the int8 integers or fp8 values that an exporter or
    ONNX Runtime folds ``QuantizeLinear(W)`` into). None for a layer without such a quantizer."""
    import torch

    q = getattr(layer.module, f"{layer.param_name}_quantizer", None)
    if q is None or not getattr(q, "enabled", False) or getattr(q, "amax", None) is None:
        return None
    with torch.no_grad():
        w = layer.weight.detach().float()
        fq = q(w).float()
        scale = (q.export_amax() / q.maxbound).float().to(w.device)
        if q.axis is not None and scale.numel() > 1:
            shape = [1] * w.dim()
            shape[q.axis] = -1
            scale = scale.reshape(shape)
        codes = fq / scale
    return layer.as_gemm(fq).cpu().numpy(), layer.as_gemm(codes).cpu().numpy()


def _same_weight(a: Any, w: Any, quantized: tuple[Any, Any] | None) -> bool:
    """Whether the initializer ``a`` holds the weight ``w`` (both (out, in, *k)): equal in float, or, for a quantized
    layer, its folded codes (integer: within 1, a tie rounded the other way; fp8: within one e4m3 step) or its
    dequantized fake-quantized values."""
    import numpy as np

    if a.shape != w.shape:
        return False
    if a.dtype.kind == "f" and a.dtype.itemsize >= 2 and np.array_equal(a.astype(np.float32), w):
        return True
    if quantized is None:
        return False
    fq, codes = quantized
    if a.dtype.kind in "iu":  # int8 / uint8 codes (symmetric: zero point 0)
        return bool(np.abs(a.astype(np.float32) - np.round(codes)).max(initial=0.0) <= 1.0)
    if a.dtype.itemsize == 1:  # fp8 codes (ml_dtypes float8_e4m3fn from onnx.numpy_helper)
        return bool(np.allclose(a.astype(np.float32), codes, rtol=0.125, atol=2.0 ** -9))
    return bool(np.allclose(a.astype(np.float32), fq, rtol=1e-5, atol=1e-7))  # stored dequantized


# Operators whose B input is stored (K, N) = (in, out) unless a transB attribute says otherwise: ONNX's own and the
# fused / integer ones ONNX Runtime's optimizer writes (com.microsoft), with the index of B among their inputs.
_B_INPUT = {"MatMul": 1, "Gemm": 1, "MatMulInteger": 1, "MatMulIntegerToFloat": 1, "DynamicQuantizeMatMul": 1,
            "FusedMatMul": 1, "FusedGemm": 1, "QLinearMatMul": 3}


def _matmul_b_weights(graph: Any) -> set[str]:
    """Initializers a MatMul-like operator reads as its B input without transB (``_B_INPUT``: MatMul, Gemm, and ONNX
    Runtime's MatMulIntegerToFloat, QLinearMatMul, ...), directly or through Quantize / DequantizeLinear: stored
    (in, out), so their 2:4 groups run along dim 0 (a Linear on a 3-D input exports so, and a Hugging Face Conv1D).
    An empty set when the graph has no such reader."""
    producer = {o: node for node in graph.node for o in node.output}
    out: set[str] = set()
    for node in graph.node:
        b = _B_INPUT.get(node.op_type)
        if b is not None and not any(a.name == "transB" and a.i for a in node.attribute):
            if len(node.input) <= b:
                continue
            name = node.input[b]
            while name in producer and producer[name].op_type in ("QuantizeLinear", "DequantizeLinear"):
                name = producer[name].input[0]
            out.add(name)
    return out
