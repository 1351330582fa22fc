"""pytorch-quantization's ``utils``: ``reduce_amax``, the reduction the qdqbert ``quant_trainer`` uses to
recalibrate weights (``pytorch_quantization.utils.reduce_amax(w, axis=..., keepdims=True)``).

Example:
    >>> import torch
    >>> w = torch.tensor([[1.0, -3.0], [0.5, 2.0]])
    >>> reduce_amax(w, axis={1}).tolist(), float(reduce_amax(w))
    ([[3.0], [2.0]], 3.0)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def reduce_amax(input: torch.Tensor, axis: int | Iterable[int] | None = None, keepdims: bool = True) -> torch.Tensor:
    """max |input| over ``axis`` (None: every dimension, a 0-d result). With ``keepdims`` the reduced
    dimensions stay with length 1 (the shape pytorch-quantization keeps a per-channel amax in); a result with
    one element is squeezed to 0-d, as there. overdrive's quantizers take either shape."""
    x = input.detach().abs()
    if axis is None:
        return x.amax()
    dims = [axis] if isinstance(axis, int) else sorted(axis)
    if not dims:
        return x.clone()
    out = x.amax(dim=dims, keepdim=keepdims)
    return out.squeeze() if out.numel() == 1 else out


__all__ = ["reduce_amax"]
