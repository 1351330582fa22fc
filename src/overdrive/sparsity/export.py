"""Export a pruned model: a compressed checkpoint (kept values + 2-bit indices) that loads back
exactly, and cuSPARSELt 2:4 weights on GPUs where they are measured faster than dense.

Compressed layout of a pruned weight viewed as a matrix (rows, in) (see ``masks.to_matrix``):
``values`` (rows, in/2) holds the 2 kept entries of every group of 4 in order, ``meta`` (uint8,
rows * in/8) packs their positions: 4 bits per group (first index | second << 2), two groups a byte.
Storage is values (half the weight) + 1/8 byte per weight: 0.53x an fp32 weight, 0.56x an fp16 one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity import masks as M
from overdrive.sparsity.api import from_pruned, sparsify
from overdrive.sparsity.config import SparsityConfig
from overdrive.sparsity.pruned import MASK_SUFFIX

if TYPE_CHECKING:
    from overdrive.sparsity.handle import SparseHandle

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
    handle.verify()
    sparse, dense_bytes, comp_bytes = {}, 0, 0
    skip = set()
    for layer in handle.layers:
        w = layer.weight.detach()
        # stored in the GEMM layout (out, in): a Conv1D's (in, out) weight is transposed, and back at load
        sparse[layer.name] = compress(layer.as_gemm(w.cpu()), layer.as_gemm(layer.mask.cpu()))
        if layer.transposed:
            sparse[layer.name]["transposed"] = True
        skip |= {layer.name, layer.name + MASK_SUFFIX}
        dense_bytes += w.numel() * w.element_size()
        comp_bytes += sum(sparse[layer.name][k].numel() * sparse[layer.name][k].element_size() for k in ("values", "meta"))
    state = {k: v.detach().cpu() for k, v in handle.model.state_dict().items() if k not in skip}
    payload = {"format": FORMAT, "version": VERSION, "config": handle.config.to_json(), "state": state, "sparse": sparse}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from overdrive._utils.files import atomic_torch_save

    atomic_torch_save(payload, path)
    return {"dense_weight_bytes": dense_bytes, "compressed_weight_bytes": comp_bytes}


def load_compressed(model: nn.Module, path: str | os.PathLike[str]) -> SparseHandle:
    """Load a :func:`save_compressed` file into ``model`` (dense or already sparsified with the same
    layers) and return its handle; weights and masks come back exactly.

    Example:
        >>> # handle = load_compressed(MyModel(), "model.sparse24.pt")
    """
    from overdrive._utils.files import require_file

    require_file(path, "compressed checkpoint", "write one with save_compressed / overdrive sparsify --out")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UsageError(f"{path} is not an overdrive 2:4 compressed checkpoint (format {FORMAT!r}); "
                         "write one with save_compressed / overdrive sparsify --out")
    if payload.get("version") != VERSION:
        raise UsageError(f"{path} has version {payload.get('version')}, this overdrive reads version {VERSION}")
    payload = _without_wrapper_prefix(payload, model)
    names = list(payload["sparse"])
    have = {n for n, _ in model.named_buffers() if n.endswith(MASK_SUFFIX)}
    if have:
        handle = from_pruned(model, SparsityConfig.from_json(payload["config"]))
    else:
        cfg = SparsityConfig.from_json(payload["config"]).replace(
            allowed_layer_names=tuple(n.rsplit(".", 1)[0] if "." in n else "" for n in names),
            disallowed_layer_names=(), permutation=False, allow_recompute_mask=False)
        try:
            handle = sparsify(model, cfg, compute_masks=False)
        except UsageError as exc:
            raise UsageError(f"{path} does not fit this model: {exc}") from exc
    try:
        _load_into(model, handle, payload, names, path)
    except (UsageError, RuntimeError):
        if not have:  # the masks installed above: drop them so the model is as it was and can be loaded again
            handle.remove()
        raise
    return handle


_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile's and DDP's / FSDP's wrappers


def _without_wrapper_prefix(payload: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """A file saved from ``torch.compile(model)`` or a DDP-wrapped model names its layers ``_orig_mod.x`` /
    ``module.x``; loaded into the plain model those names matched nothing ("no prunable layer"). The wrapper's
    prefix is dropped where the model lacks it (and kept for a model wrapped the same way)."""
    modules = {n for n, _ in model.named_modules()}
    changed = True
    while changed:
        changed = False
        names = list(payload["sparse"])
        for pre in _WRAPPER_PREFIXES:
            if names and all(n.startswith(pre) for n in names) and not any(n.rsplit(".", 1)[0] in modules
                                                                           for n in names):
                cut = len(pre)
                payload = {**payload, "sparse": {n[cut:]: v for n, v in payload["sparse"].items()},
                           "state": {(k[cut:] if k.startswith(pre) else k): v for k, v in payload["state"].items()}}
                changed = True
                break
    return payload


def _load_into(model: nn.Module, handle: SparseHandle, payload: dict[str, Any], names: list[str],
               path: str | os.PathLike[str]) -> None:
    got = {layer.name for layer in handle.layers}
    if got != set(names):
        raise UsageError(f"{path} holds pruned weights {sorted(set(names) - got)[:3]} this model does not prune, or this "
                         f"model prunes {sorted(got - set(names))[:3]} which the file lacks; use the model it was saved from")
    state = dict(payload["state"])
    params = dict(model.named_parameters())
    for name, entry in payload["sparse"].items():
        target = params.get(name)
        flip = (lambda t: t.t()) if entry.get("transposed") else (lambda t: t)  # noqa: E731 - a Conv1D's (in, out)
        shape = tuple(entry["shape"])[::-1] if entry.get("transposed") else tuple(entry["shape"])
        if target is not None and tuple(target.shape) != shape:
            raise UsageError(f"{name}: the file's weight is {shape}, the model's is {tuple(target.shape)}")
        state[name] = flip(decompress(entry)).contiguous()
        state[name + MASK_SUFFIX] = flip(_mask_from_meta(entry)).contiguous()
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # torch's message: a header line, then the mismatched keys
        detail = " ".join(line.strip() for line in str(exc).splitlines()[1:])[:400]
        raise UsageError(f"{path} does not fit this model ({detail}); load it into the model it was saved from") from exc


def _mask_from_meta(entry: dict[str, Any]) -> torch.Tensor:
    ones = {"values": torch.ones_like(entry["values"], dtype=torch.float32), "meta": entry["meta"], "shape": entry["shape"]}
    return decompress(ones).bool()


# --- cuSPARSELt export ------------------------------------------------------------------------


# the cuSPARSELt half lives in sparsity/kernels.py (SparseHandle.export calls it; handle.py must not import this module)
from overdrive.sparsity.kernels import check_sparse_gpu, semi_structured_weight, to_semi_structured  # noqa: E402,F401
