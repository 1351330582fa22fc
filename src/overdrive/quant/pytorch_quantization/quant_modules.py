"""pytorch-quantization's ``quant_modules``: ``initialize()`` makes ``torch.nn.Linear`` / ``Conv1d`` / ``Conv2d``
/ ``Conv3d`` / ``ConvTranspose1d/2d/3d`` and the average pools (``AvgPool1d/2d/3d``, ``AdaptiveAvgPool1d/2d/3d``, as
pytorch-quantization swaps them) build quantized layers until ``deactivate()``; its LSTM stays float.

This is the one place overdrive replaces torch attributes, because the scripts being ported call
``initialize()`` before building a torchvision-style model: it only rebinds the names in ``torch.nn``
(the classes themselves, their ``forward`` and ``torch.nn.modules.*`` are untouched), only when asked, and
``deactivate()`` (or leaving the :func:`enabled` block) puts them back. As in pytorch-quantization, code that
bound ``Linear`` before ``initialize()`` (``from torch.nn import Linear``) still builds float layers, and while
active ``isinstance(layer, torch.nn.Linear)`` is False for float layers built before.
The native way, with no patching: build the float model, then ``overdrive.quant.quantize(model, config, loop)``.

Example:
    >>> import torch
    >>> initialize()
    >>> try:
    ...     layer = torch.nn.Linear(4, 2)
    ... finally:
    ...     deactivate()
    >>> type(layer).__name__, torch.nn.Linear.__name__, isinstance(layer, torch.nn.Linear)
    ('QuantLinear', 'Linear', True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from overdrive._utils.errors import UsageError
from overdrive.quant.pytorch_quantization import nn as quant_nn


class _quant_entry(NamedTuple):  # noqa: N801 - pytorch-quantization's name: scripts read entry.orig_mod etc.
    orig_mod: Any
    mod_name: str
    replace_mod: type


_DEFAULT_QUANT_MAP = tuple(_quant_entry(torch.nn, name, getattr(quant_nn, f"Quant{name}")) for name in (
    "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    *(f"{kind}{d}d" for kind in ("AvgPool", "AdaptiveAvgPool") for d in (1, 2, 3))))
"""What initialize() rebinds: ``(orig_mod, mod_name, replace_mod)`` entries, as pytorch-quantization's (the
YOLO / PointPillars QAT scripts read it to swap layers of an already built model themselves)."""
# in pytorch-quantization's list but not swapped here (they stay float): naming them in float_module_list is fine
_KEPT_FLOAT = ("LSTM", "LSTMCell")
# (module, name) -> the original class, while initialize() is in effect. Process-wide by nature: the names it
# rebinds in torch.nn are process-wide.
_ORIGINALS: dict[tuple[Any, str], type] = {}


def initialize(float_module_list: Sequence[str] | None = None,
               custom_quant_modules: Sequence[tuple[Any, str, type]] | None = None) -> None:
    """Rebind ``torch.nn.Linear`` etc. to the quantized layers. ``float_module_list``: names to leave alone
    (e.g. ``["Linear"]``); ``custom_quant_modules``: extra ``(module, "Name", QuantClass)`` entries."""
    skip = set(float_module_list or ())
    unknown = skip - {name for _, name, _ in _DEFAULT_QUANT_MAP} - set(_KEPT_FLOAT)
    if unknown:
        raise UsageError(f"float_module_list names {sorted(unknown)} are not swapped anyway; swapped: "
                         f"{[name for _, name, _ in _DEFAULT_QUANT_MAP]}")
    entries = [e for e in _DEFAULT_QUANT_MAP if e[1] not in skip] + list(custom_quant_modules or ())
    for module, name, quant_cls in entries:
        _ORIGINALS.setdefault((module, name), getattr(module, name))
        setattr(module, name, quant_cls)


def deactivate() -> None:
    """Put back every name :func:`initialize` rebound."""
    while _ORIGINALS:
        (module, name), original = _ORIGINALS.popitem()
        setattr(module, name, original)


@contextlib.contextmanager
def enabled(**kwargs: Any) -> Iterator[None]:
    """``initialize(**kwargs)`` for the block, then ``deactivate()``, also when the block raises."""
    initialize(**kwargs)
    try:
        yield
    finally:
        deactivate()


__all__ = ["initialize", "deactivate", "enabled"]
