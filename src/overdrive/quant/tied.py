"""Input embeddings tied to a converted LM head: one low-precision copy of the vocabulary matrix.

GPT-2 and many small Llama-style models tie ``lm_head.weight`` to the input embedding (one Parameter under both
names). ``weight_only``, ``dynamic_int8`` and ``to_real`` replace the head by a layer that holds int8 / int4 / fp8
weights; the embedding, left as it was, would keep the float matrix too (vocab x hidden, stored twice). Such an
embedding becomes a :class:`TiedEmbedding` instead: it looks its rows up in the head's low-precision weights and
dequantizes just those rows, so the model holds (and saves) the vocabulary matrix once, as the float model did.

Example:
    >>> import torch
    >>> from overdrive import quant
    >>> emb = torch.nn.Embedding(64, 32)
    >>> model = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(32, 64, bias=False)})
    >>> model["head"].weight = emb.weight  # tied
    >>> model = quant.weight_only(model, bits=8, group_size=32, min_features=0)
    >>> type(model["emb"]).__name__
    'TiedEmbedding'
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError


class TiedEmbedding(nn.Module):
    """An ``nn.Embedding`` whose table is a converted head's low-precision weight (rows = output features).

    The head is referenced, not registered as a submodule: it stays registered once, under its own name, so
    ``state_dict`` lists its weights once and ``model.to(...)`` moves them once. ``weight`` reads back the whole
    dequantized table (as the head's does) and cannot be assigned.

    Example:
        >>> from overdrive.quant.weight_only import WeightOnlyLinear
        >>> head = WeightOnlyLinear.from_linear(torch.nn.Linear(32, 64), bits=8, group_size=32)
        >>> emb = TiedEmbedding(head, torch.nn.Embedding(64, 32))
        >>> ids = torch.tensor([[3, 5]])
        >>> torch.equal(emb(ids), head.weight[ids])
        True
    """

    def __init__(self, head: nn.Module, embedding: nn.Embedding) -> None:
        super().__init__()
        object.__setattr__(self, "head", head)  # not a submodule (see the class docstring)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (*) int -> (*, embedding_dim)
        rows = getattr(self.head, "rows", None)
        if rows is not None:
            return rows(ids)
        return F.embedding(ids, self.head.weight)  # a layer without row access: dequantize the whole table

    @property
    def weight(self) -> torch.Tensor:
        """The (num_embeddings, embedding_dim) table, dequantized from the head on each read (a Parameter that
        needs no grad: Hugging Face's ``tie_weights()`` looks the embedding's weight up as a Parameter, and then
        meets the head's read-only error, which says what to do, instead of a lookup error)."""
        return nn.Parameter(self.head.weight, requires_grad=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":

            raise read_only_weight_error(self, f"no table of its own (it reads the tied head's low-precision "
                                               f"{type(self.head).__name__} weights)")
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to {type(self.head).__name__}"


def tied_embeddings(model: nn.Module) -> dict[int, list[str]]:
    """``id(weight)`` -> names of the plain ``nn.Embedding`` modules (no ``max_norm``, which rewrites the table)
    holding that Parameter: where a converted head finds the embeddings tied to it.

    Example:
        >>> m = nn.ModuleDict({"e": nn.Embedding(4, 2)})
        >>> list(tied_embeddings(m).values())
        [['e']]
    """
    out: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        if type(m) is nn.Embedding and m.max_norm is None:
            out.setdefault(id(m.weight), []).append(name)
    return out


def retie(model: nn.Module, ties: dict[int, list[str]], old: nn.Module, new: nn.Module) -> list[str]:
    """Point the embeddings that shared ``old``'s (float) weight at ``new``, the layer ``old`` was converted to;
    returns their names. ``ties``: :func:`tied_embeddings` of the model before conversion.

    Example:
        >>> # names = retie(model, ties_before, float_head, converted_head)
    """
    names = ties.pop(id(getattr(old, "weight", None)), [])
    for name in names:
        emb = model.get_submodule(name)
        tied = TiedEmbedding(new, emb)
        for mod in list(model.modules()):  # every name the embedding is registered under
            for key, child in list(mod._modules.items()):
                if child is emb:
                    setattr(mod, key, tied)
    return names


def read_only_weight_error(layer: nn.Module, holds: str) -> UsageError:
    """The error for assigning ``weight`` on a converted layer, whose ``weight`` is a read-only dequantized view.
    Hugging Face's ``tie_weights`` does it (``lm_head.weight = embed_tokens.weight``); without this error nn.Module
    raised a bare ``KeyError: "attribute 'weight' already exists"``.

    Example:
        >>> str(read_only_weight_error(nn.Identity(), "int8 weights")).split(":")[0]
        'Identity.weight is read-only'
    """
    return UsageError(f"{type(layer).__name__}.weight is read-only: the layer holds {holds} and `weight` dequantizes "
                      "them on each read, so it cannot be assigned or tied to another tensor (Hugging Face "
                      "`tie_weights()` / `resize_token_embeddings` tie lm_head to the input embedding). Tie or resize "
                      "before converting, or keep that layer float (exclude=(\"lm_head\",))")
