"""apex.contrib.sparsity.sparse_masklib: ``create_mask``."""

from __future__ import annotations

import torch

from overdrive._utils.errors import UsageError
from overdrive.sparsity.masks import CALCULATORS, compute_mask

__all__ = ["create_mask"]


def create_mask(tensor: torch.Tensor, pattern: str = "m4n2_1d", density: float = 0.5) -> torch.Tensor:
    """apex's ``create_mask``: the 2:4 mask of ``tensor`` (a Linear weight (out, in), a conv weight (out, in, *k)),
    in ``tensor``'s dtype (1 keeps a weight, 0 prunes it), groups of 4 along the input dimension.

    Example:
        >>> w = torch.tensor([[0.1, -3.0, 2.0, 0.2]])
        >>> create_mask(w).tolist()
        [[0.0, 1.0, 1.0, 0.0]]
    """
    if pattern not in CALCULATORS:
        raise UsageError(f"pattern={pattern!r} is not one of {sorted(CALCULATORS)}")
    if density != 0.5:
        raise UsageError(f"density={density!r}: the {pattern} patterns keep 2 of every 4 weights, density 0.5")
    if tensor.dim() == 1:  # as apex: a vector is one row of groups of 4
        return compute_mask(tensor.detach().reshape(1, -1), pattern).reshape(tensor.shape).to(tensor.dtype)
    if tensor.dim() < 1:
        raise UsageError(f"create_mask got a tensor of shape {tuple(tensor.shape)}; give a weight of at least 1 "
                         "dimension (out, in, ...)")
    return compute_mask(tensor.detach(), pattern).to(tensor.dtype)
