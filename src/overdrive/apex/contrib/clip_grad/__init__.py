"""``apex.contrib.clip_grad``: ``clip_grad_norm_``, apex's multi-tensor gradient clipping, as torch's (whose foreach
kernels do the same: one norm over all gradients, one scaling pass). MONAI's and NVIDIA's training scripts import
it beside ``FusedAdam``.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.full((4,), 3.0)
    >>> float(clip_grad_norm_([w], max_norm=1.0)), round(float(w.grad.norm()), 4)
    (6.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so their joint ``norm_type`` norm is at most ``max_norm``; returns the
    norm before clipping (apex's signature, torch's ``clip_grad_norm_`` with its foreach kernels)."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type,
                                          error_if_nonfinite=error_if_nonfinite, foreach=None)


__all__ = ["clip_grad_norm_"]
