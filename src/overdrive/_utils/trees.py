"""Walking the tensors of a batch or a model output: nested tuples, lists, dicts, namedtuples, the containers torch's
pytree knows (a Hugging Face ``ModelOutput``) and, unlike pytree, a user's own ``@dataclass`` instances (frozen or not,
at any depth), without registering their types with pytree (a process-wide change).

Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass
    ... class Batch:
    ...     x: torch.Tensor
    ...     y: torch.Tensor
    >>> to64 = lambda t: t.double() if isinstance(t, torch.Tensor) else t
    >>> b = map_tensors(to64, {"batch": Batch(torch.ones(2), torch.zeros(2))})
    >>> b["batch"].x.dtype, len(tensor_leaves(b))
    (torch.float64, 2)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_is_leaf, tree_map


def is_plain_dataclass(x: Any) -> bool:
    """A dataclass instance that torch's pytree does not know (a user's ``@dataclass`` batch or output), which pytree
    would hand over whole as one leaf. A registered one (Hugging Face's ``ModelOutput``) is walked by pytree itself."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and tree_is_leaf(x)


def _map_dataclass(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to each field's value; ``obj`` itself when no value changed.

    A shallow copy whose fields are set in place of the originals: frozen dataclasses, ``init=False`` fields and
    attributes outside the fields survive, and neither ``__init__`` nor ``__post_init__`` runs again (they may
    validate, move or allocate)."""
    new = {}
    for f in dataclasses.fields(obj):
        if not hasattr(obj, f.name):  # an init=False field never set
            continue
        old = getattr(obj, f.name)
        value = fn(old)
        if value is not old:
            new[f.name] = value
    if not new:
        return obj
    out = copy.copy(obj)
    for name, value in new.items():
        try:
            setattr(out, name, value)  # a class's own __setattr__ may keep other views in step
        except dataclasses.FrozenInstanceError:
            object.__setattr__(out, name, value)
    return out


def map_tensors(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``tree_map(fn, obj)`` that also walks dataclass instances pytree does not know; ``fn`` sees every leaf (tensors
    and anything else: strings, ints), as with ``tree_map``. A dataclass none of whose values changed comes back as
    the very object."""

    def visit(x: Any) -> Any:
        if is_plain_dataclass(x):
            return _map_dataclass(lambda v: map_tensors(fn, v), x)
        return fn(x)

    if isinstance(obj, torch.Tensor):  # the common batch: no pytree walk
        return fn(obj)
    return tree_map(visit, obj, is_leaf=is_plain_dataclass)


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in pytree order (a dataclass's in field order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []

    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found.append(x)
        return x

    map_tensors(visit, obj)
    return found
