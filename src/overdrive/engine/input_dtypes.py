"""Which dtype each input of a model takes, where nothing states it: int64 for token ids and indices, bool for masks,
from the input's name (``input_ids``) or from how the model uses it (``torch.fx`` on a module, the graph of a
TorchScript file). A float index fails the export ("Expected tensor for argument #1 'indices' to have ... Long")."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

# inputs that hold token ids, masks or positions when a model takes them by these names: made as int64
INTEGER_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "decoder_input_ids",
                  "decoder_attention_mask", "labels", "pixel_mask")


def integer_dtypes(names: list[str]) -> dict[str, torch.dtype]:
    """int64 for the inputs whose names say they hold token ids, masks or positions.

    Example:
        >>> integer_dtypes(["input_ids", "pixel_values"])
        {'input_ids': torch.int64}
    """
    return {n: torch.int64 for n in names if n in INTEGER_INPUTS}


# how a module's forward uses an input that holds indices or a mask (torch.fx): made as float32, an index input
# failed the export ("Expected tensor for argument #1 'indices' to have ... Long, Int")
_FX_INDEX_MODULES = (nn.Embedding, nn.EmbeddingBag)
_FX_INDEX_FUNCS = {"embedding": 0, "embedding_bag": 0, "gather": 2, "index_select": 2, "take_along_dim": 1, "one_hot": 0}
_FX_BOOL_FUNCS = {"invert": 0, "logical_not": 0, "logical_and": 0, "logical_or": 0, "masked_fill": 1, "where": 0}
_FX_SAME_VALUES = {"reshape", "view", "flatten", "unsqueeze", "squeeze", "contiguous", "transpose", "permute", "expand",
                   "clone", "narrow", "repeat", "getitem", "t"}


def module_input_dtypes(module: nn.Module, names: list[str]) -> dict[str, torch.dtype]:
    """int64 for the forward inputs that index (an ``nn.Embedding``/``EmbeddingBag``, ``gather``, ``index_select``,
    ``table[idx]``), bool for those used as a mask (``~mask``, ``masked_fill``, ``where``), as far as ``torch.fx`` can
    trace the module without inputs; {} where it cannot (data-dependent control flow: Hugging Face models go by input
    names).

    Example:
        >>> class Bag(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.bag = nn.EmbeddingBag(10, 4)
        ...     def forward(self, ids, x, mask):
        ...         return self.bag(ids.flatten(1)) + x.masked_fill(~mask, 0.0)
        >>> module_input_dtypes(Bag(), ["ids", "x", "mask"])
        {'ids': torch.int64, 'mask': torch.bool}
    """
    try:
        import torch.fx

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = torch.fx.symbolic_trace(module)
    except Exception:  # noqa: BLE001 - not traceable without inputs: the names (and calibration data) decide
        return {}
    mods = dict(gm.named_modules())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: dict[str, torch.dtype] = {}
    for name, ph in zip(names, placeholders):
        todo, seen, dtype = [ph], set(), None
        while todo and dtype is None:
            node = todo.pop()
            for user in node.users:
                pos = next((i for i, a in enumerate(user.args) if a is node), None)
                what = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
                if user.op == "call_module" and isinstance(mods.get(user.target), _FX_INDEX_MODULES) and pos == 0:
                    dtype = torch.int64
                elif user.op in ("call_function", "call_method") and _FX_INDEX_FUNCS.get(what, -1) == pos:
                    dtype = torch.int64
                elif user.op in ("call_function", "call_method") and _FX_BOOL_FUNCS.get(what, -1) == pos:
                    dtype = torch.bool
                elif what == "getitem" and len(user.args) > 1 and user.args[0] is not node and any(
                        a is node for a in (user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],))):
                    dtype = torch.int64  # the index of a tensor: table[idx], x[:, idx] (a float index fails to export)
                elif what in _FX_SAME_VALUES and pos == 0 and user not in seen:
                    seen.add(user)
                    todo.append(user)
                if dtype is not None:
                    break
        if dtype is not None:
            out[name] = dtype
    return out


# how a TorchScript graph uses an input that holds indices or a mask, (op, argument position): the file does not
# record input dtypes, and an index input given as floats fails the export (embedding needs Long or Int indices)
_INDEX_USES = {("aten::embedding", 1), ("aten::embedding_bag", 1), ("aten::embedding_bag", 2),
               ("aten::_embedding_bag", 1), ("aten::_embedding_bag", 2), ("aten::index_select", 2),
               ("aten::gather", 2), ("aten::one_hot", 0), ("aten::take", 1), ("aten::take_along_dim", 1)}
_BOOL_USES = {("aten::bitwise_not", 0), ("aten::logical_not", 0), ("aten::logical_and", 0), ("aten::logical_and", 1),
              ("aten::logical_or", 0), ("aten::logical_or", 1), ("aten::logical_xor", 0), ("aten::logical_xor", 1),
              ("aten::masked_fill", 1), ("aten::masked_fill_", 1), ("aten::where", 0)}
# ops that pass their first argument's values on unchanged: an index input reshaped before its embedding_bag
_SAME_VALUES = {"aten::reshape", "aten::view", "aten::flatten", "aten::unsqueeze", "aten::squeeze", "aten::contiguous",
                "aten::slice", "aten::select", "aten::transpose", "aten::permute", "aten::expand", "aten::clone",
                "aten::narrow", "aten::t", "aten::repeat"}


def torchscript_inputs(scripted: Any) -> list[tuple[str, torch.dtype]]:
    """The inputs of a TorchScript module's forward as (name, dtype): the name its graph gives (``input_ids``), the
    dtype from how the graph uses it: int64 where it indexes (embedding, gather) or its name says token ids or a
    mask, bool where it is a mask (``~mask``, masked_fill, where), else float32.

    Example:
        >>> class Lookup(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = nn.Embedding(10, 4)
        ...     def forward(self, ids, x):
        ...         return self.emb(ids.flatten(1)).sum(1) + x
        >>> torchscript_inputs(torch.jit.trace(Lookup(), (torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 4))))
        [('ids', torch.int64), ('x', torch.float32)]
    """
    values = list(scripted.inlined_graph.inputs())[1:]  # [0] is the module itself
    out = []
    for v in values:
        name = v.debugName().split(".")[0]
        dtype = integer_dtypes([name]).get(name)
        todo, seen = [v], set()
        while todo and dtype is None:
            value = todo.pop()
            for use in value.uses():
                kind = use.user.kind()
                if (kind, use.offset) in _INDEX_USES:
                    dtype = torch.int64
                elif (kind, use.offset) in _BOOL_USES:
                    dtype = torch.bool
                elif kind in _SAME_VALUES and use.offset == 0 and id(use.user) not in seen:
                    seen.add(id(use.user))
                    todo.extend(use.user.outputs())
                if dtype is not None:
                    break
        out.append((name, dtype or torch.float32))
    return out
