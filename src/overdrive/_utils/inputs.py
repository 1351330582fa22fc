"""How a module takes its inputs: by name (``model(input_ids=ids, attention_mask=mask)``) or by position, and
which names a tuple of inputs stands for. Shared by ONNX export (quant), engines and calibration loading.

Hugging Face models (transformers 5) must be called by name: their forward wrappers inject keyword
arguments (``use_cache``) that collide with a positional trace, and their parameter order is not the
order tokenizers return (GPT-2's forward is ``(input_ids, past_key_values, attention_mask, ...)``).

Example:
    >>> from torch import nn
    >>> class Tok(nn.Module):
    ...     def forward(self, input_ids=None, cache=None, attention_mask=None):
    ...         return input_ids
    >>> default_input_names(Tok(), 2)
    ['input_ids', 'attention_mask']
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

# The order Hugging Face tokenizers return a text model's inputs in (and the order a tuple means for one).
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class ByName(nn.Module):
    """Calls ``module`` with its inputs as keyword arguments (``module(input_ids=x0, attention_mask=x1)``),
    plus the fixed keyword arguments ``extra`` (``use_cache=False``).

    The TorchScript ONNX exporter traces a positional call, which Hugging Face models (transformers 5)
    reject: their forward wrappers inject keyword arguments (``use_cache``) that then collide."""

    def __init__(self, module: nn.Module, names: Sequence[str], extra: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.module, self.names, self.extra = module, list(names), dict(extra or {})

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.module(**dict(zip(self.names, xs)), **self.extra)


def forward_parameters(module: nn.Module) -> dict[str, inspect.Parameter] | None:
    """The parameters of ``module.forward`` by name (None when it has no signature Python can read)."""
    try:
        return dict(inspect.signature(getattr(module, "forward", module)).parameters)
    except (TypeError, ValueError):
        return None


def takes_names(module: nn.Module, names: Sequence[str]) -> bool:
    """Whether every one of ``names`` is a named parameter of ``module.forward`` (so it can be called by name)."""
    params = forward_parameters(module)
    if params is None or not names:
        return False
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return all(n in named for n in names)


def is_token_model(module: nn.Module) -> bool:
    """A text model in Hugging Face's convention: its forward takes ``input_ids`` by name."""
    return takes_names(module, ["input_ids"])


def positional_range(module: nn.Module) -> tuple[int, int | None]:
    """How many positional inputs ``module.forward`` takes: (required, most); most is None for ``*args``."""
    params = forward_parameters(module)
    if params is None:
        return 0, None
    pos = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params.values()):
        return sum(p.default is p.empty for p in pos), None
    return sum(p.default is p.empty for p in pos), len(pos)


def default_input_names(module: nn.Module, n: int) -> list[str] | None:
    """The names ``n`` inputs given as a tuple stand for: for a token model (its forward takes ``input_ids``)
    the tokenizer's order, ``input_ids, attention_mask, token_type_ids``; else the first ``n`` positional
    parameters of forward. None when that is not known (``forward(*xs)``, or more inputs than parameters)."""
    params = forward_parameters(module)
    if params is None:
        return None
    if is_token_model(module) and n <= len(TOKEN_INPUTS) and takes_names(module, TOKEN_INPUTS[:n]):
        return list(TOKEN_INPUTS[:n])
    pos = [name for name, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return pos[:n] if len(pos) >= n else None


def call(module: nn.Module, names: Sequence[str] | None, inputs: Sequence[torch.Tensor]) -> Any:
    """``module(**dict(zip(names, inputs)))`` when forward takes every name, else ``module(*inputs)``."""
    if names is not None and takes_names(module, names):
        return module(**dict(zip(names, inputs)))
    return module(*inputs)


def pad_token_id(module: nn.Module) -> int | None:
    """The padding token id of a Hugging Face model's config (``model.config.pad_token_id``), if it has one."""
    pad = getattr(getattr(module, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None
