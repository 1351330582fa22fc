"""apex's ``apex_C`` extension: ``flatten`` and ``unflatten`` (one contiguous buffer for a list of tensors, and views
of such a buffer shaped like the list), as torch ops on any device.

Example:
    >>> import torch
    >>> grads = [torch.ones(2, 2), torch.zeros(3)]
    >>> flat = flatten(grads); flat.shape
    torch.Size([7])
    >>> views = unflatten(flat, grads); views[0].shape, views[0].data_ptr() == flat.data_ptr()
    (torch.Size([2, 2]), True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from overdrive._utils.errors import UsageError


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor holding ``tensors`` one after another (they must share a dtype and device)."""
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` with the shapes of ``tensors``, in order: writing to them writes ``flat`` (apex's
    all-reduce buffers rely on it)."""
    n = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != n:
        raise UsageError(f"unflatten: the flat tensor has shape {tuple(flat.shape)} but the tensors hold {n} elements;"
                         " pass a 1-D tensor of that many elements (flatten(tensors) makes one)")
    return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


__all__ = ["flatten", "unflatten"]
