"""apex.fp16_utils: ``to_python_float``. apex's FP16_Optimizer and network_to_half are not here: use
``amp.initialize(..., opt_level="O2")``, which keeps the fp32 master weights they kept."""

from __future__ import annotations

from typing import Any


def to_python_float(t: Any) -> float:
    """A one-element tensor (or a number) as a Python float: ``t.item()``, as apex did.

    Example:
        >>> import torch
        >>> to_python_float(torch.tensor(0.5))
        0.5
    """
    if hasattr(t, "item"):
        return t.item()
    return t[0] if isinstance(t, (list, tuple)) else float(t)
