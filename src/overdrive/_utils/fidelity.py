"""How close a model's outputs are to a reference's: per-sample cosine (the mean and the worst sample), max error
over the output range, top-1.

One implementation for the engine's build-time accuracy check (``engine/accuracy.py``) and quantize's fidelity on
the user's calibration data (``quant/fidelity.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def _sample_cosines(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(N,) cosine per sample; a sample where both are zero agrees (1), a non-finite engine value disagrees (0)."""
    a = ref.reshape(ref.shape[0], -1) if ref.dim() >= 2 else ref.reshape(1, -1)
    b = out.reshape(a.shape)
    bad = ~torch.isfinite(b).all(dim=1)
    b = torch.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0)
    na, nb = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(dim=1) / (na * nb).clamp_min(1e-300)
    cos = torch.where((na == 0) & (nb == 0), torch.ones_like(cos), cos)
    return torch.where(bad, torch.zeros_like(cos), cos.clamp(-1.0, 1.0))


SMALL_SAMPLE = 0.05
"""A sample whose reference and output norms are both below this fraction of the batch's median sample norm is left
out of the worst-sample cosine: per-tensor int8 rounding is absolute (about 1% of a typical sample's norm), so on a
near-zero sample its direction is noise, not a verdict. A wrong output of normal size, or a normal reference turned
to zero, still counts."""


def _worst_cosine(ref: torch.Tensor, out: torch.Tensor, cos: torch.Tensor) -> float:
    """The lowest of ``cos`` (N,) over the samples that carry signal (see :data:`SMALL_SAMPLE`)."""
    a = ref.reshape(ref.shape[0], -1) if ref.dim() >= 2 else ref.reshape(1, -1)
    b = torch.nan_to_num(out.reshape(a.shape), nan=math.inf)  # a non-finite sample always counts
    norm = torch.maximum(a.norm(dim=1), b.norm(dim=1))  # (N,)
    keep = norm >= SMALL_SAMPLE * float(norm.median()) if norm.numel() else norm.bool()
    return float(cos[keep].min()) if bool(keep.any()) else 1.0


def compare_outputs(refs: Sequence[Sequence[torch.Tensor]], outs: Sequence[Sequence[torch.Tensor]],
                    names: Sequence[str]) -> dict[str, Any]:
    """Cosine, relative max error and (one 2-D output) top-1 agreement of ``outs`` against ``refs``: one list of
    output tensors per batch each. Integer and bool outputs are left out; outputs whose shapes differ are named.

    ``cosine`` is the mean over samples (dim 0) of each sample's cosine; ``worst_cosine`` the lowest sample's
    (samples of near-zero norm left out), so that one wrong sample among many right ones shows. Each is the worst
    over outputs.

    Example:
        >>> compare_outputs([[torch.ones(2, 3)]], [[2 * torch.ones(2, 3)]], ["y"])["cosine"]
        1.0
        >>> r = compare_outputs([[torch.tensor([[1.0, 0.0], [1.0, 0.0]])]], [[torch.tensor([[1.0, 0.0], [0.0, 1.0]])]], ["y"])
        >>> r["cosine"], r["worst_cosine"]
        (0.5, 0.0)
    """
    per: dict[str, dict[str, Any]] = {}
    cos: dict[str, list[torch.Tensor]] = {}
    worst: dict[str, float] = {}
    err: dict[str, float] = {}
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    agree = [0, 0]
    floats = [i for i, r in enumerate(refs[0]) if r.is_floating_point()] if refs else []
    one_2d = len(floats) == 1 and refs[0][floats[0]].dim() == 2 and refs[0][floats[0]].shape[1] >= 2
    for ref_b, out_b in zip(refs, outs):
        for i in floats:
            name = names[i] if i < len(names) else f"output{i}"
            r, o = ref_b[i].detach().cpu().double(), out_b[i].detach().cpu().double()
            if tuple(r.shape) != tuple(o.shape):
                per[name] = {"error": f"shape {tuple(o.shape)}, the reference's is {tuple(r.shape)}"}
                continue
            c = _sample_cosines(r, o)
            cos.setdefault(name, []).append(c)
            worst[name] = min(worst.get(name, 1.0), _worst_cosine(r, o, c))
            diff = (o - r).abs()
            e = float(diff.max()) if diff.numel() else 0.0
            err[name] = max(err.get(name, 0.0), e if math.isfinite(e) else math.inf)
            if r.numel():
                lo[name], hi[name] = min(lo.get(name, math.inf), float(r.min())), max(hi.get(name, -math.inf), float(r.max()))
            if one_2d:
                agree[0] += int((r.argmax(dim=1) == o.argmax(dim=1)).sum())
                agree[1] += r.shape[0]
    for name, cs in cos.items():
        span = hi.get(name, 0.0) - lo.get(name, 0.0)
        span = span if span > 0 else max(abs(hi.get(name, 0.0)), abs(lo.get(name, 0.0)), 1.0)
        rel = err[name] / span
        per[name] = {"cosine": round(float(torch.cat(cs).mean()), 6), "worst_cosine": round(worst[name], 6),
                     "rel_max_err": round(rel, 6) if math.isfinite(rel) else 1e9}
    measured = [p for p in per.values() if "cosine" in p]
    cosine = min(p["cosine"] for p in measured) if measured else None
    worst_cosine = min(p["worst_cosine"] for p in measured) if measured else None
    if any("error" in p for p in per.values()):
        cosine = worst_cosine = 0.0  # an output of another shape than the model's: the engine is wrong
    return {"cosine": cosine, "worst_cosine": worst_cosine, "rel_max_err": max(p["rel_max_err"] for p in measured) if measured else None,
            "top1": round(agree[0] / agree[1], 6) if agree[1] else None, "outputs": per}
