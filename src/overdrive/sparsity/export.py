"""Export a pruned model: a compressed checkpoint (kept values + 2-bit indices) that loads back
exactly, and cuSPARSELt 2:4 weights on GPUs where they are measured faster than dense.

Compressed layout of a pruned weight viewed as a matrix (rows, in) (see ``masks.to_matrix``):
``values`` (rows, in/2) holds the 2 kept entries of every group of 4 in order, ``meta`` (uint8,
rows * in/8) packs their positions: 4 bits per group (first index | second << 2), two groups a byte.
Storage is values (half the weight) + 1/8 byte per weight: 0.53x an fp32 weight, 0.56x an fp16 one.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.timing import time_fn
from overdrive.sparsity import masks as M

if TYPE_CHECKING:
    from overdrive._utils.table import Table
    from overdrive.sparsity.api import SparseHandle

FORMAT = "overdrive.sparse24"
VERSION = 1


def compress(weight: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Values + packed 2-bit metadata of a 2:4 ``weight`` under ``mask`` (exact, any dtype).

    Example:
        >>> w = torch.randn(8, 16); m = M.compute_mask(w)
        >>> torch.equal(decompress(compress(w * m, m)), w * m)
        True
    """
    if tuple(mask.shape) != tuple(weight.shape):
        raise UsageError(f"mask shape {tuple(mask.shape)} does not match weight shape {tuple(weight.shape)}; "
                         "pass the weight's own mask")
    mat, mmat = M.to_matrix(weight.detach()), M.to_matrix(mask.bool())
    rows, cols = mat.shape
    if cols % 8:
        raise UsageError(f"compressed 2:4 storage needs in % 8 == 0, got weight shape {tuple(weight.shape)}")
    groups = mmat.reshape(rows, cols // 4, 4)
    if not bool((groups.sum(-1) == 2).all()):
        raise UsageError("mask must keep exactly 2 of every 4 to be stored compressed; recompute the masks")
    values = mat.reshape(rows, cols // 4, 4)[groups].reshape(rows, cols // 2).clone()
    idx = groups.nonzero()[:, 2].reshape(rows, cols // 4, 2).to(torch.uint8)  # kept positions, ascending
    code = idx[..., 0] | (idx[..., 1] << 2)  # (rows, cols/4) 4-bit codes
    code = code.reshape(rows, cols // 8, 2)
    meta = (code[..., 0] | (code[..., 1] << 4)).contiguous()
    return {"values": values, "meta": meta, "shape": list(weight.shape)}


def decompress(entry: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`compress`: the dense pruned weight, bit-exact."""
    values, meta, shape = entry["values"], entry["meta"], tuple(entry["shape"])
    rows, half = values.shape
    cols = half * 2
    code = torch.stack([meta & 0xF, meta >> 4], dim=-1).reshape(rows, cols // 4)
    idx = torch.stack([code & 0x3, (code >> 2) & 0x3], dim=-1).long()  # (rows, cols/4, 2)
    mat = torch.zeros(rows, cols // 4, 4, dtype=values.dtype, device=values.device)
    mat.scatter_(-1, idx, values.reshape(rows, cols // 4, 2))
    return M.from_matrix(mat.reshape(rows, cols), shape)


def save_compressed(handle: SparseHandle, path: str | os.PathLike[str]) -> dict[str, int]:
    """Write the pruned model: pruned weights compressed, masks implied, the rest as a state_dict.

    Returns byte counts {"dense_weight_bytes", "compressed_weight_bytes"} for the pruned weights.

    Example:
        >>> # stats = save_compressed(handle, "model.sparse24.pt")
    """
    from overdrive.sparsity.api import MASK_SUFFIX

    handle.verify()
    sparse, dense_bytes, comp_bytes = {}, 0, 0
    skip = set()
    for layer in handle.layers:
        w = layer.weight.detach()
        sparse[layer.name] = compress(w.cpu(), layer.mask.cpu())
        skip |= {layer.name, layer.name + MASK_SUFFIX}
        dense_bytes += w.numel() * w.element_size()
        comp_bytes += sum(sparse[layer.name][k].numel() * sparse[layer.name][k].element_size() for k in ("values", "meta"))
    state = {k: v.detach().cpu() for k, v in handle.model.state_dict().items() if k not in skip}
    payload = {"format": FORMAT, "version": VERSION, "config": handle.config.to_json(), "state": state, "sparse": sparse}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return {"dense_weight_bytes": dense_bytes, "compressed_weight_bytes": comp_bytes}


def load_compressed(model: nn.Module, path: str | os.PathLike[str]) -> SparseHandle:
    """Load a :func:`save_compressed` file into ``model`` (dense or already sparsified with the same
    layers) and return its handle; weights and masks come back exactly.

    Example:
        >>> # handle = load_compressed(MyModel(), "model.sparse24.pt")
    """
    from overdrive.sparsity.api import MASK_SUFFIX, sparsify
    from overdrive.sparsity.config import Config

    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UsageError(f"{path} is not an overdrive 2:4 compressed checkpoint (format {FORMAT!r}); "
                         "write one with save_compressed / overdrive sparsify --out")
    if payload.get("version") != VERSION:
        raise UsageError(f"{path} has version {payload.get('version')}, this overdrive reads version {VERSION}")
    names = list(payload["sparse"])
    have = {n for n, _ in model.named_buffers() if n.endswith(MASK_SUFFIX)}
    if have:
        from overdrive.sparsity.api import from_pruned

        handle = from_pruned(model, Config.from_json(payload["config"]))
    else:
        cfg = Config.from_json(payload["config"]).replace(
            allowed_layer_names=tuple(n.rsplit(".", 1)[0] if "." in n else "" for n in names),
            disallowed_layer_names=(), permutation=False, allow_recompute_mask=False)
        try:
            handle = sparsify(model, cfg, compute_masks=False)
        except UsageError as exc:
            raise UsageError(f"{path} does not fit this model: {exc}") from exc
    got = {layer.name for layer in handle.layers}
    if got != set(names):
        raise UsageError(f"{path} holds pruned weights {sorted(set(names) - got)[:3]} this model does not prune, or this "
                         f"model prunes {sorted(got - set(names))[:3]} which the file lacks; use the model it was saved from")
    state = dict(payload["state"])
    params = dict(model.named_parameters())
    for name, entry in payload["sparse"].items():
        target = params.get(name)
        if target is not None and tuple(target.shape) != tuple(entry["shape"]):
            raise UsageError(f"{name}: the file's weight is {tuple(entry['shape'])}, the model's is {tuple(target.shape)}")
        w = decompress(entry)
        state[name] = w
        state[name + MASK_SUFFIX] = _mask_from_meta(entry)
    model.load_state_dict(state, strict=True)
    return handle


def _mask_from_meta(entry: dict[str, Any]) -> torch.Tensor:
    ones = {"values": torch.ones_like(entry["values"], dtype=torch.float32), "meta": entry["meta"], "shape": entry["shape"]}
    return decompress(ones).bool()


# --- cuSPARSELt export ------------------------------------------------------------------------
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
