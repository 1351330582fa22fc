"""apex.multi_tensor_apply: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls
``op(chunk_size, noop_flag, tensor_lists, *args)``, as apex's does, for the ops of :mod:`overdrive.apex.amp_C`.

Example:
    >>> import torch
    >>> from overdrive.apex import amp_C
    >>> noop = torch.zeros(1, dtype=torch.int); g = [torch.full((2,), 8.0)]
    >>> multi_tensor_applier(amp_C.multi_tensor_scale, noop, [g, g], 1 / 8); g[0].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class MultiTensorApply:
    """apex's callable: passes ``chunk_size`` (apex's default 2048 * 32) first. ``available`` is always True (apex:
    False without its CUDA extension)."""

    available = True

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """apex raised here without its CUDA extension; the ops here need none."""

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: torch.Tensor,
                 tensor_lists: Sequence[Sequence[torch.Tensor]], *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
