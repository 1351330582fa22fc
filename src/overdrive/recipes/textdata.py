"""A real text task that needs no download, for the sparsity accuracy benchmark: which standard
library module does a 64-byte chunk of a docstring come from (12 modules, docstrings of their
functions, classes and methods as shipped with this Python). Split by docstring, not by chunk, so
no text is shared between train and test. Also a small byte-level transformer that fx can trace."""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn

MODULES = ("tkinter", "logging", "inspect", "ssl", "tarfile", "typing", "ast", "threading", "pathlib", "zipfile",
           "collections", "http.client")
SEQ = 64


def _docstrings(modname: str) -> list[str]:
    try:
        mod = importlib.import_module(modname)
    except ImportError:
        return []
    out = []
    for _, obj in sorted(inspect.getmembers(mod), key=lambda kv: kv[0]):
        if getattr(obj, "__module__", None) != mod.__name__ or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        items = [obj] + ([a for _, a in sorted(vars(obj).items()) if inspect.isfunction(a)] if inspect.isclass(obj) else [])
        for it in items:
            doc = inspect.getdoc(it)
            if doc and len(doc) >= 40:
                out.append(" ".join(doc.split()))
    return out


def load_docstring_task(seed: int = 0, test_fraction: float = 0.2) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): byte chunks (N, SEQ) int64 (0 = padding), module labels."""
    g = torch.Generator().manual_seed(seed)
    xs: dict[str, list[torch.Tensor]] = {"train": [], "test": []}
    ys: dict[str, list[int]] = {"train": [], "test": []}
    for label, name in enumerate(MODULES):
        docs = _docstrings(name)
        order = torch.randperm(len(docs), generator=g).tolist()
        n_test = max(1, round(len(docs) * test_fraction))
        for rank, i in enumerate(order):
            split = "test" if rank < n_test else "train"
            data = docs[i].encode("utf-8", "replace")
            for start in range(0, max(1, len(data) - SEQ // 2), SEQ):  # non-overlapping chunks
                chunk = list(data[start:start + SEQ])
                if len(chunk) < 24:
                    continue
                t = torch.zeros(SEQ, dtype=torch.int64)
                t[:len(chunk)] = torch.tensor(chunk) + 1
                xs[split].append(t)
                ys[split].append(label)
    return (torch.stack(xs["train"]), torch.tensor(ys["train"]), torch.stack(xs["test"]), torch.tensor(ys["test"]))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.fc1, self.act, self.fc2 = nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class ByteTransformer(nn.Module):
    """(B, SEQ) bytes -> (B, classes) logits; pre-LN blocks, mean pooling."""

    def __init__(self, classes: int = len(MODULES), d: int = 32, heads: int = 2, ffn: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(257, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d, heads, ffn) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(x) + self.pos)  # (B, T, d)
        return self.head(self.ln(h).mean(dim=1))
