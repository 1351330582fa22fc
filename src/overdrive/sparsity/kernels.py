"""2:4 weights on sparse tensor cores: cuSPARSELt semi-structured tensors, kept only where measured faster
than dense (inference only).

Example:
    >>> # table = to_semi_structured(model.half().cuda(), handle)   # a GPU with sparse tensor cores (sm80+)
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.timing import time_fn

if TYPE_CHECKING:
    from overdrive._utils.table import Table
    from overdrive.sparsity.handle import SparseHandle


def check_sparse_gpu(device: torch.device) -> None:
    """Raise unless ``device`` is a GPU with sparse tensor cores and torch has a 2:4 kernel for it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UsageError(f"sparse 2:4 export needs an NVIDIA GPU with sparse tensor cores (sm80+); device {device} has "
                         "none. Keep the dense model, or save a compressed checkpoint (save_compressed) instead")
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 0):
        raise UsageError(f"GPU {torch.cuda.get_device_name(device)} (sm{cc[0]}{cc[1]}) has no sparse tensor cores "
                         "(they start at sm80, Ampere); keep the dense model")
    cslt = bool(getattr(torch.backends, "cusparselt", None) and torch.backends.cusparselt.is_available())
    if not cslt and cc[0] != 8:
        raise UsageError(f"torch here has no cuSPARSELt and its CUTLASS 2:4 kernels support only sm8x, not sm{cc[0]}{cc[1]}")


def _cuda_median_ms(fn: Any, iters: int = 20, warmup: int = 5) -> float:
    return statistics.median(time_fn(fn, "cuda", warmup=warmup, repeat=iters)) * 1e3


def semi_structured_weight(w: torch.Tensor, x: torch.Tensor | None = None, search: bool = True) -> torch.Tensor:
    """``to_sparse_semi_structured(w)``, with cuSPARSELt's algorithm search against ``x`` (tokens, in)."""
    from torch.sparse import to_sparse_semi_structured

    sp = to_sparse_semi_structured(w)
    if search and x is not None and getattr(sp, "packed", None) is not None and hasattr(sp, "alg_id_cusparselt"):
        try:
            res = torch._cslt_sparse_mm_search(sp.packed, x.t())
            sp.alg_id_cusparselt = int(res[0] if isinstance(res, (tuple, list)) else res)
            # The search runs one operand layout; F.linear runs another, for which the id found can be
            # invalid (seen on the H200 in bf16: "invalid value" from cusparseLtMatmulAlgSetAttribute).
            torch.nn.functional.linear(x, sp)
        except (RuntimeError, TypeError):  # the search is best-effort; alg 0 always works
            sp.alg_id_cusparselt = 0
    return sp


def to_semi_structured(model: nn.Module, handle: SparseHandle, tokens: int = 4096, min_speedup: float = 1.0,
                       search: bool = True) -> Table:
    """Swap each pruned Linear's weight for a cuSPARSELt 2:4 tensor when its F.linear at ``tokens``
    rows is at least ``min_speedup`` x faster than dense; others stay dense, and the table says why.

    Inference only (the weight no longer trains). Weights must already be fp16/bf16 on the GPU.
    """
    from overdrive._utils.table import Table

    table = Table("2:4 export (cuSPARSELt)", ["layer", "shape", "dense ms", "sparse ms", "speedup", "kept"])
    linears = [layer for layer in handle.layers if isinstance(layer.module, nn.Linear) and layer.param_name == "weight"]
    if not linears:
        raise UsageError("no pruned Linear layer to export (cuSPARSELt export covers Linear weights)")
    device = linears[0].weight.device
    check_sparse_gpu(device)
    with torch.no_grad():
        for layer in linears:
            mod, w = layer.module, layer.weight.detach()
            if w.dtype not in (torch.float16, torch.bfloat16):
                raise UsageError(f"{layer.name} is {w.dtype}; cast the model to fp16/bf16 (model.half()) before export")
            x = torch.randn(tokens, w.shape[1], device=device, dtype=w.dtype)
            dense_ms = _cuda_median_ms(lambda: F.linear(x, w, mod.bias))
            try:
                # bf16 + searched algorithm: the layer timed fine here but failed later in the model's
                # forward on the H200 (torch 2.11: "invalid value" from cusparseLtMatmulAlgSetAttribute),
                # so bf16 layers keep cuSPARSELt's default algorithm.
                sp = semi_structured_weight(w, x, search and w.dtype == torch.float16)
                sparse_ms = _cuda_median_ms(lambda: F.linear(x, sp, mod.bias))
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                table.rows.append([layer.name, "x".join(map(str, w.shape)), dense_ms, None, None,
                                   f"dense ({type(exc).__name__}: {str(exc)[:60]})"])
                continue
            speed = dense_ms / sparse_ms
            if speed >= min_speedup:
                mod.weight = nn.Parameter(sp, requires_grad=False)
                kept = "sparse"
            else:
                kept = f"dense (sparse is {speed:.2f}x)"
            table.rows.append([layer.name, "x".join(map(str, w.shape)), dense_ms, sparse_ms, speed, kept])
    n = sum(r[-1] == "sparse" for r in table.rows)
    table.notes.append(f"{n} of {len(table.rows)} Linear layers use cuSPARSELt; the rest stay dense because sparse was not "
                       f">= {min_speedup}x faster at {tokens} tokens (overdrive never makes a layer slower silently)")
    return table
