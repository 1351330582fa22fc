"""Swapping converted layers into a model, and keyword settings over a config: shared by ``to_real`` (real.py) and
``weight_only`` (weight_only.py), which must not import each other."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.config import RealConfig, WeightOnlyConfig


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in place of the submodule ``name`` wherever that module is registered: a layer shared under several
    names (ALBERT-style ``nn.ModuleList([block] * n)``, an alias attribute) is listed once by ``named_modules``, and
    replacing only that name left the other names on the old (fake-quant or float) layer, silently."""
    parent, _, leaf = name.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    old = holder._modules.get(leaf)
    setattr(holder, leaf, new)
    if old is None:
        return
    for mod in list(model.modules()):
        for key, child in list(mod._modules.items()):
            if child is old:
                setattr(mod, key, new)


C = TypeVar("C", RealConfig, WeightOnlyConfig)


def _config(cls: type[C], config: C | None, settings: dict[str, Any]) -> C:
    """``config`` (or the defaults) with the keyword settings replaced; an unknown keyword is a UsageError."""
    if config is not None and not isinstance(config, cls):
        raise UsageError(f"config={config!r} must be an overdrive.quant.{cls.__name__}")
    return (config if config is not None else cls()).replace(**settings)
