"""Fast tokenization for text datasets: a Hugging Face fast tokenizer in batches, across processes,
cached on disk (the same idea as the image pipeline: keep the input side off the critical path).
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing as mp
import numbers
import os
import re
import warnings
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.files import atomic_write
from overdrive._utils.optional import require
from overdrive.data.config import usable_cpus


@dataclass
class TokenizedTexts:
    """Token ids of many texts, stored flat: text i is ``ids[offsets[i]:offsets[i+1]]``.

    ``padding_side`` ("right" or "left") is where :meth:`padded` puts the padding by default; :func:`tokenize` sets
    it from the tokenizer (a transformers tokenizer's ``padding_side``, a ``tokenizers.Tokenizer``'s padding
    direction), so a decoder-only model's left-padding tokenizer gives left-padded batches, as its own call does.

    Example:
        >>> t = TokenizedTexts(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]))
        >>> t[0], len(t)
        ([5, 6], 2)
    """

    ids: np.ndarray  # (total tokens,) int32
    offsets: np.ndarray  # (N + 1,) int64
    from_cache: bool = False
    padding_side: str = "right"

    def __post_init__(self) -> None:
        _check_side(self.padding_side, "padding_side")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int | slice) -> list[int] | list[list[int]]:
        n = len(self.offsets) - 1
        if isinstance(i, slice):  # texts[1:3]: their id lists, as a list of lists would give
            return [self[j] for j in range(*i.indices(n))]
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} texts")
        i %= n  # negative indices count from the end, as in a list
        return self.ids[self.offsets[i]:self.offsets[i + 1]].tolist()

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the ids and offsets to ``path`` (``.npz``; ``np.load(path)["ids"]``, ``["offsets"]`` read them back,
        text i being ``ids[offsets[i]:offsets[i+1]]``); returns the path.

        Example:
            >>> import tempfile
            >>> t = TokenizedTexts(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]))
            >>> np.load(t.save(Path(tempfile.mkdtemp()) / "ids.npz"))["ids"].tolist()
            [5, 6, 7]
        """
        out = Path(path).expanduser()
        if out.suffix != ".npz":
            raise UsageError(f"{str(path)!r}: expected a .npz path (numpy's archive of the ids and offsets), e.g. "
                             "tokens.npz")
        buf = io.BytesIO()
        start, end = int(self.offsets[0]), int(self.offsets[-1])  # this object's texts only (a window of a buffer)
        np.savez(buf, ids=self.ids[start:end], offsets=self.offsets - start)
        atomic_write(out, buf.getvalue())
        return out

    def padded(self, pad_id: int = 0, max_length: int | None = None,
               side: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, L) int64 ids padded with ``pad_id`` and the (N, L) attention mask (1 on tokens, 0 on padding); ``L`` is
        ``max_length`` (longer texts keep their first ``L`` tokens) or the longest text's length.

        ``side`` ("right" or "left") is where the padding goes; None takes :attr:`padding_side`, the tokenizer's
        (``tokenizer(texts, padding=True)`` pads on the same side). Left padding puts each text's last token in
        the last column, where a decoder-only model's ``generate`` continues from.

        Example:
            >>> t = TokenizedTexts(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]))
            >>> t.padded(pad_id=9)[0].tolist()
            [[5, 6], [7, 9]]
            >>> ids, mask = t.padded(pad_id=9, side="left")
            >>> ids.tolist(), mask.tolist()
            ([[5, 6], [9, 7]], [[1, 1], [0, 1]])
        """
        if max_length is not None and not (_is_int(max_length) and max_length >= 1):
            raise UsageError(f"max_length={max_length!r} must be an int >= 1 (longer texts are cut to it), or None "
                             "(the longest text's length)")
        if not _is_int(pad_id):
            raise UsageError(f"pad_id={pad_id!r} must be an int token id, e.g. tokenizer.token_to_id('[PAD]')")
        side = self.padding_side if side is None else side
        _check_side(side, "side")
        lens = self.lengths()
        L = int(max_length if max_length is not None else (lens.max() if len(lens) else 0))
        # whole arrays, not a Python loop over the texts (a million texts: 11 s before, under 2 s now): the mask from
        # the lengths, then every kept token in row-major order, which is the order of the flat ids
        kept = np.minimum(lens, L)[:, None]
        # left: a text's tokens fill the last columns of its row; either way the True cells of a row, read in
        # row-major order, take that text's tokens in order
        keep = np.arange(L)[None, :] >= L - kept if side == "left" else np.arange(L)[None, :] < kept
        flat = self.ids[int(self.offsets[0]):int(self.offsets[-1])] if len(self) else self.ids[:0]
        if len(self) and int(lens.max()) > L:  # texts cut at L: their tokens past it are left out
            cols = np.arange(len(flat)) - np.repeat(self.offsets[:-1] - self.offsets[0], lens)
            flat = flat[cols < L]
        ids = np.full((len(self), L), pad_id, dtype=np.int64)
        ids[keep] = flat
        mask = keep.astype(np.int64)
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def packed(self, block_size: int, eos_id: int | None = None) -> torch.Tensor:
        """(B, block_size) int64 blocks of every text's ids laid end to end, for causal-LM training (Hugging Face's
        ``group_texts``, nanoGPT's token stream): ``eos_id`` (if given) follows each text, so a block that spans two
        texts shows where one ends; the tokens after the last whole block are dropped. No padding and no mask: every
        position is a token. Shift by one for the targets (``x = b[:, :-1], y = b[:, 1:]``).

        Example:
            >>> t = TokenizedTexts(np.array([5, 6, 7, 8, 9], np.int32), np.array([0, 2, 5]))
            >>> t.packed(3, eos_id=0).tolist()  # 5 6 0 7 8 9 0: two blocks, the last 0 dropped
            [[5, 6, 0], [7, 8, 9]]
        """
        if not (_is_int(block_size) and block_size >= 1):
            raise UsageError(f"block_size={block_size!r} must be an int >= 1 (tokens per block)")
        if eos_id is not None and not _is_int(eos_id):
            raise UsageError(f"eos_id={eos_id!r} must be an int token id (e.g. tokenizer.token_to_id('</s>')) or None")
        # this object's texts only: offsets may window a shared ids buffer (a train / val split of one tokenization)
        start = int(self.offsets[0])
        flat = self.ids[start:int(self.offsets[-1])]
        if eos_id is None:
            stream = flat
        else:  # each text's ids, then eos_id: one copy of the stream, no Python loop over texts
            stream = np.empty(len(flat) + len(self), dtype=np.int64)
            ends = self.offsets[1:] - start + np.arange(1, len(self) + 1)  # where each text's eos lands
            is_eos = np.zeros(len(stream), dtype=bool)
            is_eos[ends - 1] = True
            stream[is_eos] = eos_id
            stream[~is_eos] = flat
        n = len(stream) // block_size
        if n == 0:
            raise UsageError(f"{len(stream)} tokens make no block of block_size={block_size}; give a block_size of at "
                             f"most {len(stream)}, or more texts")
        return torch.from_numpy(np.ascontiguousarray(stream[: n * block_size], dtype=np.int64)).view(n, block_size)


def _check_side(side: Any, name: str) -> None:
    if side not in ("right", "left"):
        raise UsageError(f"{name}={side!r} must be 'right' or 'left' (where the padding goes; a decoder-only model "
                         "generating from a batch wants 'left')")


def _padding_side(tokenizer: Any, tok: Any) -> str:
    """Where ``tokenizer(texts, padding=True)`` (transformers) or its enabled padding (tokenizers) pads: "right"
    unless it says "left"."""
    if hasattr(tokenizer, "backend_tokenizer"):
        side = getattr(tokenizer, "padding_side", "right")
    else:
        side = (tok.padding or {}).get("direction", "right")
    return "left" if side == "left" else "right"


def _backend(tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer`` from a Tokenizer, a transformers fast tokenizer, or a tokenizer.json path."""
    tk = require("tokenizers", extra="text", feature="overdrive.data.tokenize")
    if isinstance(tokenizer, tk.Tokenizer):
        return tokenizer
    if hasattr(tokenizer, "backend_tokenizer"):  # transformers PreTrainedTokenizerFast
        return tokenizer.backend_tokenizer
    if isinstance(tokenizer, (str, os.PathLike)) and Path(tokenizer).is_file():
        try:
            return tk.Tokenizer.from_file(str(tokenizer))
        except Exception as exc:  # tokenizers raises a bare Exception ("expected value at line 1 column 1")
            raise UsageError(f"tokenizer file {str(tokenizer)!r} is not a tokenizer.json ({exc}); pass the "
                             "tokenizer.json a tokenizers.Tokenizer saved (tok.save(path)) or a fast tokenizer "
                             "wrote (save_pretrained)") from None
    if isinstance(tokenizer, (str, os.PathLike)) and (Path(tokenizer) / "tokenizer.json").is_file():
        raise UsageError(f"tokenizer {str(tokenizer)!r} is a folder; pass its tokenizer.json "
                         f"({str(Path(tokenizer) / 'tokenizer.json')!r}) or "
                         f"AutoTokenizer.from_pretrained({str(tokenizer)!r})")
    if isinstance(tokenizer, (str, os.PathLike)):
        raise UsageError(f"tokenizer {str(tokenizer)!r} is not a file; pass the path of a tokenizer.json, a "
                         "tokenizers.Tokenizer, or a transformers fast tokenizer (AutoTokenizer.from_pretrained(name))")
    kind = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
    if callable(getattr(tokenizer, "encode", None)) and hasattr(tokenizer, "model_max_length"):  # transformers, slow
        # the type only: a tokenizer's repr lists every added token (hundreds of lines for ByT5)
        raise UsageError(f"tokenizer is a slow (Python) transformers tokenizer ({kind}), which tokenize cannot run "
                         "in batches or worker processes; pass the model's fast tokenizer "
                         "(AutoTokenizer.from_pretrained(name) loads it where the model has one), or tokenize "
                         "with the slow one directly: [tokenizer(t)['input_ids'] for t in texts]")
    shown = repr(tokenizer)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise UsageError(f"tokenizer {shown} ({kind}) is not a tokenizers.Tokenizer, a transformers fast tokenizer, "
                     "or a path to a tokenizer.json")


# Per-process worker state: each worker process builds its tokenizer once (in _init_worker) and
# reuses it for every chunk; the parent process never touches this dict.
_WORKER: dict[str, Any] = {}


def _prepared(tok: Any, max_length: int | None, hf_truncation_side: str | None) -> str:
    """JSON of a copy of the caller's tokenizer (its settings untouched) that encodes a batch as the caller's
    ``encode`` would each text.

    - A plain ``tokenizers.Tokenizer`` keeps its own truncation and padding (``encode`` applies them);
      ``max_length`` replaces the truncation length and keeps its direction and strategy.
    - A transformers fast tokenizer (``hf_truncation_side`` set) is set up as its ``__call__``/``encode`` set its
      backend on every call: no padding, truncation only with ``max_length``, on its ``truncation_side``.
      Whatever an earlier call left on the shared backend (``truncation=True, max_length=8``) is ignored.
    - Batch-longest padding stays in the JSON (the cache key) but is applied per text by :func:`_encode`: in
      ``encode_batch`` it would make every text's ids depend on the others in its chunk.

    The JSON is the cache key's tokenizer part, so any of these settings changing gives a new key."""
    t = require("tokenizers").Tokenizer.from_str(tok.to_str())
    if hf_truncation_side is not None:
        t.no_truncation()
        t.no_padding()
        if max_length:
            t.enable_truncation(max_length, direction=hf_truncation_side)
    elif max_length:
        old = t.truncation or {}
        t.enable_truncation(max_length, **{k: old[k] for k in ("strategy", "direction") if k in old})
    return t.to_str()


def _encode_special_tokens(tokenizer: Any, tok: Any) -> bool:
    """Whether special tokens written in a text are split as plain text: transformers' ``split_special_tokens``
    (set on the backend by each call) or the Tokenizer's ``encode_special_tokens``. ``to_str()`` drops it, so it
    travels beside the JSON, in the cache key too."""
    if hasattr(tokenizer, "backend_tokenizer"):
        return bool(getattr(tokenizer, "split_special_tokens", False))
    return bool(getattr(tok, "encode_special_tokens", False))


def _load(tok_json: str, encode_special_tokens: bool) -> tuple[Any, dict[str, Any] | None]:
    """The tokenizer of ``_prepared``'s JSON for ``encode_batch``, and the padding :func:`_encode` applies per
    text (batch-longest padding with ``pad_to_multiple_of``: ``encode`` pads one text to a multiple of it)."""
    t = require("tokenizers").Tokenizer.from_str(tok_json)
    if encode_special_tokens:
        t.encode_special_tokens = True
    pad = t.padding
    if pad is None or pad.get("length") is not None:  # none, or fixed-length: encode_batch pads as encode does
        return t, None
    t.no_padding()
    return t, pad if pad.get("pad_to_multiple_of") else None


def _encode(tok: Any, pad: dict[str, Any] | None, texts: list[str],
            add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
    encodings = tok.encode_batch(texts, add_special_tokens=add_special_tokens)
    if pad is not None:  # each text to the next multiple of its own length, as encode(text) pads it
        m = pad["pad_to_multiple_of"]
        for e in encodings:
            e.pad(-(-len(e.ids) // m) * m, direction=pad["direction"], pad_id=pad["pad_id"],
                  pad_type_id=pad["pad_type_id"], pad_token=pad["pad_token"])
    return _flatten(encodings)


def _init_worker(tok_json: str, encode_special_tokens: bool, add_special_tokens: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes are the parallelism
    _WORKER["tok"], _WORKER["pad"] = _load(tok_json, encode_special_tokens)
    _WORKER["special"] = add_special_tokens


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode(_WORKER["tok"], _WORKER["pad"], texts, _WORKER["special"])


def _flatten(encodings: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    ids = np.fromiter((t for e in encodings for t in e.ids), dtype=np.int32, count=int(lens.sum()))
    return ids, lens


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _cache_key(tok_json: str, texts: Sequence[str], max_length: int | None, add_special_tokens: bool,
               encode_special_tokens: bool = False) -> str:
    h = hashlib.sha256()
    h.update(tok_json.encode())
    h.update(f"|{max_length}|{add_special_tokens}|{len(texts)}|".encode())
    if encode_special_tokens:  # only when set, so that the keys of existing caches hold
        h.update(b"|encode_special_tokens|")
    for t in texts:  # each text's length first: no separator can make two lists of texts hash alike
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:32]


def _as_texts(texts: Any) -> Sequence[str]:
    """``texts`` as a sequence of str: a list or tuple as it is, any other iterable of strings (a generator, a NumPy
    array, a pandas Series) as a list; what is not texts is a UsageError saying what to pass instead."""
    if isinstance(texts, (str, os.PathLike)):
        raise UsageError(f"texts={str(texts)[:60]!r} is one string; pass a list of texts, e.g. a file's or a folder's: "
                         "overdrive.data.read_texts(path) (lines of .txt, a field of .jsonl, .gz too), or [text] for a "
                         "single one")
    if isinstance(texts, Mapping):
        raise UsageError(f"texts is a mapping with keys {list(texts)[:5]}; pass the column of texts, e.g. "
                         "texts['text']")
    if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Iterable):
        raise UsageError(f"texts must be a list of strings, got {type(texts).__name__}")
    if not isinstance(texts, (list, tuple)):
        texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            hint = (f"; a JSONL row? pass [row[{next(iter(t))!r}] for row in rows]" if isinstance(t, Mapping) and t
                    else "; decode it first: b.decode('utf-8')" if isinstance(t, (bytes, bytearray))
                    else "; drop or replace missing texts" if t is None
                    else ("; text pairs are not supported: for one encoding of both ([CLS] a [SEP] b [SEP], with "
                          "token_type_ids) call the tokenizer itself, tokenizer(firsts, seconds, truncation="
                          "'only_second'); or tokenize each side as its own list of texts"
                          if isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t)
                          else ""))
            raise UsageError(f"texts[{i}] is a {type(t).__name__} ({str(t)[:40]!r}), expected str{hint}")
    return texts


def _raise_unencodable(texts: Sequence[str]) -> None:
    """Raise a UsageError naming the first text that is not valid Unicode (a lone surrogate, as
    ``errors='surrogateescape'`` decoding leaves for undecodable bytes); return if there is none."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UsageError(f"texts[{i}] holds {t[exc.start]!r} at character {exc.start}, a lone surrogate that is "
                             "not valid Unicode (bytes decoded with errors='surrogateescape'?); decode the source "
                             "with errors='replace', or drop the text") from None


CHUNK_SIZE = 2048  # texts per encode_batch call (and per task of a worker process)


def default_workers(n_texts: int, chunk_size: int = CHUNK_SIZE) -> int:
    """The processes :func:`tokenize` starts when ``num_workers`` is None: one per usable CPU core (the affinity
    mask's) from 8 chunks of texts up, none (this process) below that, where starting them costs more than they save.

    Example:
        >>> default_workers(100)
        0
    """
    return usable_cpus() if n_texts >= 8 * chunk_size else 0


_CACHE_FILE = re.compile(r"[0-9a-f]{32}\.npz")  # what tokenize names its cache files: nothing else is pruned


def prune_token_cache(cache_dir: str | os.PathLike, max_bytes: int, keep: str | os.PathLike | None = None) -> list[Path]:
    """Delete :func:`tokenize`'s least recently used cache files in ``cache_dir`` until the rest hold at most
    ``max_bytes``; returns the paths removed, oldest first.

    Only files named as tokenize names its caches (32 hex digits + ``.npz``) are counted or removed, so other
    files in the folder are safe. "Used" is the file's modification time, which a cache hit renews. ``keep`` (a
    cache file) is never removed, even when it alone holds more than ``max_bytes``.

    Example:
        >>> import tempfile
        >>> prune_token_cache(tempfile.mkdtemp(), max_bytes=1 << 30)
        []
    """
    if not (_is_int(max_bytes) and max_bytes >= 0):
        raise UsageError(f"max_bytes={max_bytes!r} must be an int >= 0 (the bytes the cache may keep, e.g. 10 << 30 "
                         "for 10 GiB)")
    root = Path(cache_dir).expanduser()
    if not root.is_dir():
        raise UsageError(f"cache_dir={str(cache_dir)!r} is not a folder; give the cache_dir passed to tokenize")
    keep_path = Path(keep).expanduser().resolve() if keep is not None else None
    entries = []
    for p in root.iterdir():
        if not _CACHE_FILE.fullmatch(p.name):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:  # removed meanwhile (another rank pruning the same folder)
            continue
        entries.append((st.st_mtime, p.name, st.st_size, p))
    total = sum(e[2] for e in entries)
    removed = []
    for _, _, size, p in sorted(entries):  # oldest use first
        if total <= max_bytes:
            break
        if keep_path is not None and p.resolve() == keep_path:
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        total -= size
        removed.append(p)
    return removed


def _warn_past_model_max(tokenizer: Any, out: TokenizedTexts, max_length: int | None) -> None:
    """Warn, as transformers does for ``tokenizer(text)``, when texts came out longer than the model takes: without
    ``max_length`` nothing is truncated, and the model's embedding lookup fails later with an index error."""
    limit = getattr(tokenizer, "model_max_length", None) if hasattr(tokenizer, "backend_tokenizer") else None
    # transformers' "no limit" is int(1e30) (VERY_LARGE_INTEGER)
    if max_length is not None or not _is_int(limit) or not 0 < limit < int(1e29) or len(out) == 0:
        return
    lens = out.lengths()
    over = int((lens > limit).sum())
    if over:
        warnings.warn(f"overdrive.data.tokenize: {over} of {len(out)} texts have more tokens than the tokenizer's "
                      f"model_max_length={limit} (the longest {int(lens.max())}); they were not truncated (max_length="
                      f"None), and a model with {limit} positions fails on them; pass max_length={limit} to truncate "
                      "them, as tokenizer(texts, truncation=True) does", RuntimeWarning, stacklevel=3)


def tokenize(texts: Sequence[str], tokenizer: Any, max_length: int | None = None, add_special_tokens: bool = True,
             num_workers: int | None = None, chunk_size: int = CHUNK_SIZE, cache_dir: str | os.PathLike | None = None,
             cache_max_bytes: int | None = None) -> TokenizedTexts:
    """Token ids of every text, equal to ``tokenizer.encode(text).ids`` (truncated to ``max_length``).

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (its own truncation and fixed-length padding apply, as in its
    ``encode``; ``max_length`` keeps its truncation direction), a transformers fast tokenizer (equal to
    ``tokenizer(text, truncation=max_length is not None, max_length=max_length)["input_ids"]``, on its
    ``truncation_side``), or a tokenizer.json path. Single texts only (no pairs). Texts longer than a transformers
    tokenizer's ``model_max_length`` with ``max_length=None`` are kept whole, with a ``RuntimeWarning`` (as
    transformers warns); ``max_length=tokenizer.model_max_length`` is ``tokenizer(texts, truncation=True)``. The
    result's ``padded()`` pads on the tokenizer's side (``padding_side="left"`` gives left-padded rows).

    Texts are split into chunks of ``chunk_size`` and encoded with ``encode_batch`` in
    ``num_workers`` processes (0: in this process, with the tokenizer's own threads; None: one per
    usable CPU core, the affinity mask's, for large inputs). With ``cache_dir`` the result is stored under
    a key of the tokenizer, options and texts, and a second call loads it. The cache grows with every new
    tokenizer, setting or text list; ``cache_max_bytes`` prunes it after each write to at most that many bytes,
    least recently used first (:func:`prune_token_cache`; the result just written is kept).

    Example:
        >>> # out = tokenize(texts, tokenizers.Tokenizer.from_file("tokenizer.json"), max_length=128,
        >>> #                cache_dir="~/.cache/overdrive/tok"); out[0] -> [101, 7592, ...]
    """
    texts = _as_texts(texts)
    if max_length is not None and not (_is_int(max_length) and max_length >= 1):
        raise UsageError(f"max_length={max_length!r} must be an int >= 1, or None (no truncation)")
    if not (_is_int(chunk_size) and chunk_size >= 1):
        raise UsageError(f"chunk_size={chunk_size!r} must be an int >= 1")
    if num_workers is not None and not (_is_int(num_workers) and num_workers >= 0):
        raise UsageError(f"num_workers={num_workers!r} must be an int >= 0 (0: encode in this process) or None "
                         "(one process per CPU core for large inputs)")
    if cache_max_bytes is not None and not (_is_int(cache_max_bytes) and cache_max_bytes >= 0):
        raise UsageError(f"cache_max_bytes={cache_max_bytes!r} must be an int >= 0 (e.g. 10 << 30 for 10 GiB) or None "
                         "(the cache is never pruned)")
    if cache_max_bytes is not None and cache_dir is None:
        raise UsageError("cache_max_bytes is set but cache_dir is None; pass cache_dir=... to cache (and prune) results")
    tok = _backend(tokenizer)
    post = tok.post_processor if add_special_tokens else None
    n_special = post.num_special_tokens_to_add(False) if post is not None else 0
    if max_length is not None and max_length < n_special:  # tokenizers would leave every text untruncated
        raise UsageError(f"max_length={max_length} is less than the {n_special} special tokens the tokenizer adds to "
                         f"each text, so no text would be truncated; give max_length >= {n_special + 1}, or "
                         "add_special_tokens=False")
    hf_side = getattr(tokenizer, "truncation_side", "right") if hasattr(tokenizer, "backend_tokenizer") else None
    tok_json = _prepared(tok, max_length, hf_side)  # holds max_length, truncation side and padding: the cache key's part
    split_special = _encode_special_tokens(tokenizer, tok)
    path = None
    if cache_dir is not None:
        if Path(cache_dir).expanduser().exists() and not Path(cache_dir).expanduser().is_dir():
            raise UsageError(f"cache_dir={str(cache_dir)!r} is a file; give a folder for the tokenized cache (it is "
                             "made if missing)")
        key = _cache_key(tok_json, texts, max_length, add_special_tokens, split_special)
        path = Path(cache_dir).expanduser() / f"{key}.npz"
        if path.is_file():
            try:  # allow_pickle=False: a cache file never runs code
                with np.load(path, allow_pickle=False) as z:
                    out = TokenizedTexts(z["ids"], z["offsets"], from_cache=True,
                                         padding_side=_padding_side(tokenizer, tok))
                _warn_past_model_max(tokenizer, out, max_length)
                try:
                    os.utime(path)  # used now: prune_token_cache removes the least recently used first
                except OSError:  # a read-only cache folder still serves hits
                    pass
                return out
            except FileNotFoundError:  # pruned meanwhile (another rank sharing cache_dir): tokenize again
                pass
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
                # a cache written by a killed process, or another file under its name: tokenize again, write anew
                warnings.warn(f"overdrive.data.tokenize: cache file {path} is unreadable ({type(exc).__name__}); "
                              "tokenizing again and replacing it", RuntimeWarning, stacklevel=2)
    if num_workers is None:
        num_workers = default_workers(len(texts), chunk_size)
    chunks = [list(texts[i:i + chunk_size]) for i in range(0, len(texts), chunk_size)]
    try:
        if num_workers == 0 or len(chunks) <= 1:
            local, pad = _load(tok_json, split_special)
            parts = [_encode(local, pad, c, add_special_tokens) for c in chunks]
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            # no more processes than chunks: with fork, the pool starts all of its workers at once
            with ProcessPoolExecutor(min(num_workers, len(chunks)), mp_context=ctx, initializer=_init_worker,
                                     initargs=(tok_json, split_special, add_special_tokens)) as ex:
                parts = list(ex.map(_encode_chunk, chunks))
    except TypeError:  # tokenizers' words for a text it cannot take: "TextEncodeInput must be Union[...]"
        _raise_unencodable(texts)
        raise
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
    lens = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    out = TokenizedTexts(ids, offsets, padding_side=_padding_side(tokenizer, tok))
    _warn_past_model_max(tokenizer, out, max_length)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        np.savez(buf, ids=ids, offsets=offsets)
        # a temporary file of this call's own (ranks sharing a cache_dir write the same key at once), then a
        # rename: a reader never sees half a cache file
        atomic_write(path, buf.getvalue())
        if cache_max_bytes is not None:
            prune_token_cache(path.parent, cache_max_bytes, keep=path)
    return out


def local_corpus(max_files: int = 400) -> list[str]:
    """Lines of text shipped with Python (the standard library's sources): a corpus needing no download."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for p in sorted(root.glob("*.py"))[:max_files]:
        try:
            lines += [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if len(ln.strip()) > 20]
        except (UnicodeDecodeError, OSError):
            continue
    return lines


def train_local_tokenizer(texts: Sequence[str], vocab_size: int = 8000) -> Any:
    """A WordPiece tokenizer (BERT-style normalizer, pre-tokenizer, [CLS]/[SEP]) trained on ``texts``."""
    tk = require("tokenizers", extra="text", feature="training a local tokenizer")
    tok = tk.Tokenizer(tk.models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    trainer = tk.trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
                                         show_progress=False)  # its progress lines are blank lines off a terminal
    tok.train_from_iterator(texts, trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = tk.processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok
