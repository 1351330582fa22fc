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
from overdrive.sparsity.api import SparseHandle


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
    transposed, (in, out), under a generated name (``onnx::MatMul_12``, ``val_37``). A pruned weight found neither
    way (changed by the export, or by training after it) is an error.

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
        views = [(w, False)] + ([(w.T, True)] if w.ndim == 2 else [])
        for k, a in inits.items():
            if k in taken:
                continue
            hit = next((flip for v, flip in views if a.shape == v.shape and np.array_equal(a.astype(np.float32), v)),
                       None)
            if hit is not None:
                out[layer.name] = (k, hit)
                taken.add(k)
                break
    return out


def _matmul_b_weights(graph: Any) -> set[str]:
    """Initializers a MatMul reads as its second input (or a Gemm with transB 0), directly or through Quantize /
    DequantizeLinear: stored (in, out), so their 2:4 groups run along dim 0 (a Linear on a 3-D input exports so,
    and a Hugging Face Conv1D). An empty set when the graph has no such reader."""
    producer = {o: node for node in graph.node for o in node.output}
    out: set[str] = set()
    for node in graph.node:
        if node.op_type == "MatMul" or (node.op_type == "Gemm" and not any(
                a.name == "transB" and a.i for a in node.attribute)):
            if len(node.input) < 2:
                continue
            name = node.input[1]
            while name in producer and producer[name].op_type in ("QuantizeLinear", "DequantizeLinear"):
                name = producer[name].input[0]
            out.add(name)
    return out
