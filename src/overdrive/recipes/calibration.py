"""Calibration files: one format for every verb (``overdrive build --calib``, ``overdrive quantize
--calib-data``, :func:`overdrive.recipes.build.build_engine`, :func:`overdrive.recipes.quantize.run_quantize`),
read by one function, :func:`load_calibration`.

A calibration file is written with ``torch.save`` and read with ``torch.load(weights_only=True)`` (a data
file never runs code), or is a NumPy ``.npy`` (one array, like a tensor (N, ...)) or ``.npz`` (arrays by input
name, like the dict below) read with ``allow_pickle=False``. It holds the model's inputs only, no labels, as one of:

==============================================  ===================================================
``tensor`` (N, ...)                             one input; split along dim 0 into batches of ``--batch-size``
``[tensor, ...]``                               one input; each tensor is one batch
``[(input_ids, attention_mask), ...]``          several inputs; one tuple per batch, in forward's order
                                                (a token model's: input_ids, attention_mask, token_type_ids)
``{"input_ids": (N, T), "attention_mask": ...}``  inputs by name; each split along dim 0 into batches
``[{"input_ids": ..., "attention_mask": ...}]``   inputs by name; one dict per batch
==============================================  ===================================================

A folder of images (class subfolders or flat) and a ``.txt`` file of one sample per line are read too, as
:mod:`overdrive.recipes.calib_formats` describes: resized, center-cropped and normalized to the model's input.

The ``.npz`` that ``overdrive data tokenize -o tokens.npz`` writes (``ids`` flat, ``offsets`` (N + 1,): text i is
``ids[offsets[i]:offsets[i+1]]``) is read as ``input_ids`` (N, T), right-padded with the model's
``config.pad_token_id`` (0 without one), plus the ``attention_mask`` of the texts' lengths where the model takes
one. T is the sequence length of the input shape given (``--input-shape input_ids:1x128``, a build's
``--shapes``; longer texts keep their first T tokens), else the longest text's.

Inputs by name are passed to the model by keyword and must be parameters of its forward (for an engine
built from ONNX, the model's input names). A top-level tuple of tensors is a list of batches, not one
batch of several inputs: save ``[(ids, mask)]`` or a dict for that.

Padding: when the batches give ``input_ids`` but no ``attention_mask`` and the model takes one, the mask is
derived from the model's padding id (``model.config.pad_token_id``): ``attention_mask = input_ids !=
pad_token_id``, with a warning naming how many tokens were padding, so padding never enters the ranges
unnoticed. A model whose config has no pad_token_id (GPT-2) attends to every token; save the tokenizer's
attention_mask with the ids when such batches are padded.

Example:
    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "calib.pt")
    >>> torch.save({"input_ids": torch.ones(4, 8, dtype=torch.long)}, path)
    >>> calib = load_calibration(path, batch_size=2)
    >>> calib.names, len(calib), tuple(calib.batches[0][0].shape)
    (('input_ids',), 2, (2, 8))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.inputs import (call, default_input_names, forward_parameters, pad_token_id, positional_range,
                                     takes_names)
from overdrive.recipes.calib_formats import TEXT_SUFFIXES, ImageOptions, read_image_folder, read_text_lines

FORMAT = ("save the model's inputs only (no labels) with torch.save: a tensor (N, ...), a list of batch tensors, "
          "a list of per-batch tuples [(input_ids, attention_mask), ...], or a dict of name -> tensor (N, ...) / a "
          "list of such dicts; or give a folder of images (an image model) or a .txt file, one sample per line")


# What a model raises on inputs it cannot take (wrong shape, dtype, count); reported naming the file and the batch
MODEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, AssertionError)


@dataclass(frozen=True)
class Calibration:
    """Calibration batches from one file: ``batches[k]`` holds one tensor per input, in the order of ``names``
    (None: by position, the names are not known)."""

    path: str
    names: tuple[str, ...] | None
    batches: list[tuple[torch.Tensor, ...]]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return iter(self.batches)

    def forward_loop(self) -> Callable[[nn.Module], None]:
        """A ``forward_loop`` for :func:`overdrive.quant.quantize`: every batch through the model, by keyword
        where its forward takes the names (a Hugging Face model), else by position."""

        def loop(model: nn.Module) -> None:
            dev = next((p.device for p in model.parameters()), torch.device("cpu"))
            with torch.no_grad():
                for k, batch in enumerate(self.batches):
                    try:
                        call(model, self.names, [x.to(dev) for x in batch])
                    except UsageError:
                        raise
                    except MODEL_ERRORS as exc:  # name the file and the batch, not only the op
                        # (other exceptions pass through: a caller's hook may end the loop early by raising one)
                        names = self.names or [f"input{i}" for i in range(len(batch))]
                        got = ", ".join(f"{n} {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                                        for n, x in zip(names, batch))
                        first = str(exc).splitlines()[0][:300] if str(exc) else ""
                        raise UsageError(f"{type(model).__name__} fails on calibration batch {k} of {self.path!r} "
                                         f"({got}): {type(exc).__name__}: {first}; save the inputs the model's "
                                         "forward takes, with their shapes and dtypes") from exc

        return loop

    def example(self, n: int = 2) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
        """The first ``n`` samples of the first batch: a dict by name where names are known, else a tuple."""
        first = tuple(x[:n] for x in self.batches[0])
        return dict(zip(self.names, first)) if self.names is not None else first


def _what(data: Any) -> str:
    """A short description of what a file holds, for error messages."""
    if isinstance(data, torch.Tensor):
        return f"a tensor of shape {tuple(data.shape)}"
    if isinstance(data, Mapping):
        kinds = sorted({type(v).__name__ for v in data.values()})
        return f"a dict with keys {list(data)[:5]} (values: {', '.join(kinds)})"
    if isinstance(data, (list, tuple)):
        if not data:
            return f"an empty {type(data).__name__}"
        return f"a {type(data).__name__} of {len(data)} ({', '.join(sorted({type(b).__name__ for b in data}))})"
    return f"a {type(data).__name__}"


def _split(path: str, flag: str, t: torch.Tensor, batch_size: int, name: str = "the tensor") -> list[torch.Tensor]:
    if t.dim() == 0 or len(t) == 0:
        raise UsageError(f"{flag} {path!r}: {name} has shape {tuple(t.shape)}, no samples along dim 0; {FORMAT}")
    return list(t.split(batch_size))


Batch = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


def _is_named(b: Any) -> bool:
    return isinstance(b, Mapping) and bool(b) and all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                      for k, t in b.items())


# What a state_dict's keys end with (a layer's parameters and buffers), and what a training checkpoint holds
WEIGHT_KEY_SUFFIXES = (".weight", ".bias", ".running_mean", ".running_var", ".num_batches_tracked", ".in_proj_weight")
CHECKPOINT_KEYS = ("state_dict", "model", "model_state_dict", "optimizer", "trainer")


def _weights_kind(data: Any) -> str | None:
    """What a file of weights given as calibration data is (a state_dict, a training checkpoint), from its keys;
    None for anything else. Calibration inputs are named after forward's parameters or an ONNX model's inputs
    (``input.1``), never ``fc1.weight``; a mix of such keys is taken as weights when most are.

    Example:
        >>> _weights_kind({"fc1.weight": torch.zeros(2, 2), "fc1.bias": torch.zeros(2)}), _weights_kind({"x": 1})
        ('the weights of a model (a state_dict: fc1.weight, fc1.bias)', None)
    """
    if not isinstance(data, Mapping) or not data or not all(isinstance(k, str) for k in data):
        return None
    keys = list(data)
    if sum(k.endswith(WEIGHT_KEY_SUFFIXES) for k in keys) * 2 > len(keys):
        return f"the weights of a model (a state_dict: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
    nested = [k for k in CHECKPOINT_KEYS if isinstance(data.get(k), Mapping)]
    if nested and not all(isinstance(v, torch.Tensor) for v in data.values()):
        return f"a training checkpoint (keys {keys[:5]})"
    return None


def _records(path: str, flag: str, data: Any, batch_size: int) -> list[Batch]:
    """The file's contents as batches: tuples (by position) or dicts (by name)."""
    weights = _weights_kind(data)
    if weights is not None:  # --checkpoint's file given as --calib-data: it failed as inputs of odd lengths
        raise UsageError(f"{flag} {path!r} holds {weights}, not calibration inputs; weights go to --checkpoint "
                         f"(with --model file.py:factory), and {flag} takes the model's inputs: {FORMAT}")
    bad = UsageError(f"{flag} {path!r} holds {_what(data)}; expected the calibration format: {FORMAT}")
    if isinstance(data, torch.Tensor):
        return [(b,) for b in _split(path, flag, data, batch_size)]
    if isinstance(data, Mapping):
        if not _is_named(data):
            raise bad
        parts = {k: _split(path, flag, v, batch_size, f"input {k!r}") for k, v in data.items()}
        sizes = {k: len(v) for k, v in data.items()}
        if len(set(sizes.values())) > 1:
            raise UsageError(f"{flag} {path!r}: the inputs hold different numbers of samples {sizes}; give every "
                             "input the same length along dim 0")
        return [dict(zip(parts, bs)) for bs in zip(*parts.values())]
    if not isinstance(data, (list, tuple)) or not data:
        raise bad
    if all(isinstance(b, torch.Tensor) for b in data):
        return [(b,) for b in data]
    if all(isinstance(b, (list, tuple)) and b and all(isinstance(t, torch.Tensor) for t in b) for b in data):
        return [tuple(b) for b in data]
    if all(_is_named(b) for b in data):
        keys = list(data[0])
        odd = next((k for k, b in enumerate(data) if set(b) != set(keys)), None)
        if odd is not None:
            raise UsageError(f"{flag} {path!r}: batch {odd} has inputs {sorted(data[odd])}, batch 0 {sorted(keys)}; "
                             "give every batch the same inputs")
        return [{k: b[k] for k in keys} for b in data]
    raise bad


TOKEN_ID_INPUTS = ("input_ids", "decoder_input_ids")
"""Inputs that index the model's vocabulary: checked against it before the model runs."""


def _check_token_range(path: str, flag: str, records: list[Batch], model: nn.Module) -> None:
    """Refuse token ids outside the model's vocabulary (data tokenized with another tokenizer): the model's
    embedding lookup failed mid-calibration with a bare ``IndexError: index out of range in self``."""
    from overdrive.recipes.input_shapes import _vocab_size

    vocab = _vocab_size(model)
    if vocab is None:
        return
    first = next((n for n in (forward_parameters(model) or {}) if n not in ("self", "args", "kwargs")), None)
    for name in TOKEN_ID_INPUTS:
        xs = [r.get(name) if isinstance(r, dict) else (r[0] if name == first == "input_ids" else None)
              for r in records]
        xs = [x for x in xs if isinstance(x, torch.Tensor) and x.numel() and not x.is_floating_point()]
        if not xs:
            continue
        hi, lo = max(int(x.max()) for x in xs), min(int(x.min()) for x in xs)
        if hi >= vocab or lo < 0:
            bad = hi if hi >= vocab else lo
            raise UsageError(f"{flag} {path!r}: {name} holds token id {bad}, but {type(model).__name__}'s vocabulary "
                             f"has {vocab} tokens (ids 0..{vocab - 1}); the data was tokenized with another "
                             "tokenizer: tokenize it with the model's own (overdrive data tokenize -t "
                             "<the model's tokenizer.json>)")


def _order(path: str, flag: str, names: list[str], wanted: list[str]) -> list[str]:
    """Check that the file's input names are the model's (a lone input may carry any name)."""
    if len(names) == 1 == len(wanted):
        return wanted
    missing, unknown = [n for n in wanted if n not in names], [n for n in names if n not in wanted]
    if missing or unknown:
        raise UsageError(f"{flag} {path!r} holds inputs {names} but the model takes {wanted} (missing {missing}, "
                         f"unknown {unknown}); save one tensor per model input, by those names")
    return wanted


def _with_mask(path: str, flag: str, model: nn.Module | None, names: list[str], batches: list[dict[str, torch.Tensor]],
               wanted: Sequence[str] | None) -> list[str]:
    """Add ``attention_mask`` (input_ids != pad_token_id) when the model takes one and the file has none."""
    if "input_ids" not in names or "attention_mask" in names:
        return names
    if wanted is not None:
        needs = "attention_mask" in wanted  # an engine's input: it must be given
    else:
        needs = model is not None and takes_names(model, ["attention_mask"])
    if not needs:
        return names
    pad = pad_token_id(model) if model is not None else None
    if pad is None:
        if wanted is None:  # the model's own default (no mask) attends to every token, as the file says
            return names
        warnings.warn(f"{flag} {path}: input_ids without attention_mask and no pad_token_id known (no model config); "
                      "calibrating with a mask of ones, every token attended: save the tokenizer's attention_mask "
                      "with the ids if the batches are padded", UserWarning, stacklevel=3)
        for b in batches:
            b["attention_mask"] = torch.ones_like(b["input_ids"])
        return [*names, "attention_mask"]
    padded = total = 0
    for b in batches:
        ids = b["input_ids"]
        mask = (ids != pad).to(ids.dtype)
        if mask.dim() >= 2:  # a row of padding only would leave softmax nothing: keep its first token
            empty = mask.sum(-1) == 0
            mask[..., 0] = torch.where(empty, torch.ones_like(mask[..., 0]), mask[..., 0])
        padded, total = padded + int((ids == pad).sum()), total + ids.numel()
        b["attention_mask"] = mask
    if padded:
        warnings.warn(f"{flag} {path}: input_ids without attention_mask; {padded} of {total} tokens equal "
                      f"pad_token_id={pad} (the model's config) and are masked out (attention_mask = input_ids != "
                      f"{pad}); save the tokenizer's attention_mask with the ids to choose the mask yourself",
                      UserWarning, stacklevel=3)
    return [*names, "attention_mask"]


def load_calibration(path: str, flag: str = "--calib", batch_size: int = 32, max_batches: int | None = None,
                     model: nn.Module | None = None, input_names: Sequence[str] | None = None,
                     images: ImageOptions | None = None, input_shape: Sequence[int] | None = None) -> Calibration:
    """Read a calibration file (the formats in this module's docstring) -> :class:`Calibration`.

    ``input_names``: the model's inputs in order (an engine's); the batches come back in that order and must
    hold each one. ``model``: the module the batches will be fed to; its forward's parameters name tuple
    batches (a token model's tuple is input_ids, attention_mask, token_type_ids), dict keys are checked
    against them, and its ``config.pad_token_id`` gives a missing attention_mask. ``max_batches``: keep
    the first batches only. Every problem is a one-line :class:`UsageError` naming the file, what it holds,
    and the format expected.

    ``path`` may also be a folder of images (an image model's inputs, resized and normalized as ``images``
    says; ``input_shape`` is the input's shape from elsewhere, a build's ``--shapes``) or a ``.txt`` file of one
    sample per line (a token model whose tokenizer overdrive knows): :mod:`overdrive.recipes.calib_formats`.

    Example:
        >>> # calib = load_calibration("calib.pt", "--calib-data", model=bert)
        >>> # quant.quantize(bert, quant.INT8_DEFAULT, forward_loop=calib.forward_loop())
    """
    opts = images or ImageOptions()
    check_calibration_path(path, flag)
    if Path(path).is_dir():
        data: Any = read_image_folder(path, flag, opts, model, input_shape)
    elif Path(path).suffix.lower() in TEXT_SUFFIXES:
        data = read_text_lines(path, flag, model, opts.samples)
    else:
        data = _read(path, flag)
        if _is_tokenized(data):
            data = _from_tokenized(path, flag, data, model, input_names, input_shape)
    records = _records(path, flag, data, batch_size)
    if max_batches is not None:
        records = records[:max_batches]
    if model is not None:
        _check_token_range(path, flag, records, model)
    wanted = list(input_names) if input_names is not None else None
    if isinstance(records[0], dict):
        names = list(records[0])
        if wanted is None and model is not None and len(names) == 1 and not takes_names(model, names):
            lo = positional_range(model)[0]  # a lone input may carry any name, if the model needs only one
            if lo > 1:
                params = [n for n in (forward_parameters(model) or {}) if n not in ("self", "args", "kwargs")]
                raise UsageError(f"{flag} {path!r} holds one input {names} but {type(model).__name__}.forward "
                                 f"takes {lo} (its parameters: {params[:8]}); save one tensor per input, named "
                                 "after them")
        if wanted is None and model is not None and len(names) > 1 and not takes_names(model, names):
            params = [n for n in (forward_parameters(model) or {}) if n not in ("self", "args", "kwargs")]
            unknown = [n for n in names if n not in params]
            raise UsageError(f"{flag} {path!r} holds inputs {names} but {type(model).__name__}.forward takes no "
                             f"{unknown} (its parameters: {params[:8]}); name the tensors after them")
        if wanted is None and model is not None and takes_names(model, names):
            order = list(forward_parameters(model) or {})
            names = sorted(names, key=order.index)  # forward's order, whatever order the file has
        dicts = [dict(r) for r in records]  # type: ignore[arg-type]
    else:
        n = len(records[0])
        odd = next((k for k, r in enumerate(records) if len(r) != n), None)
        if odd is not None:
            raise UsageError(f"{flag} {path!r}: batch 0 holds {n} tensor(s), batch {odd} {len(records[odd])}; give "
                             "every batch the same inputs")
        if wanted is not None:
            if n != len(wanted):
                raise UsageError(f"{flag} {path!r}: a batch holds {n} tensor{'s' * (n != 1)} but the model takes inputs {wanted}"
                                 f"{_hint(n, len(wanted))}; {FORMAT}")
            names = wanted
        else:
            names = _tuple_names(path, flag, model, n)
        if names is None:
            return Calibration(path, None, [tuple(r) for r in records])  # type: ignore[arg-type]
        dicts = [dict(zip(names, r)) for r in records]
    if wanted is not None and len(wanted) > 1 and any(n not in wanted for n in names):
        _order(path, flag, names, wanted)  # raises: an input the model does not take
    if wanted is None or len(wanted) > 1:
        names = _with_mask(path, flag, model, names, dicts, wanted)
    if wanted is not None:
        names = _order(path, flag, names, wanted)
        if len(wanted) == 1:  # a lone input under another name
            dicts = [{wanted[0]: next(iter(d.values()))} for d in dicts]
    for k, d in enumerate(dicts):
        sizes = {n: len(t) if t.dim() else 0 for n, t in d.items()}
        if len(set(sizes.values())) > 1:
            raise UsageError(f"{flag} {path!r}: batch {k} holds inputs of different batch sizes {sizes}; each batch "
                             "needs the same number of samples in every input")
    return Calibration(path, tuple(names), [tuple(d[n] for n in names) for d in dicts])


def check_calibration_path(path: str, flag: str = "--calib") -> None:
    """Refuse a calibration path that is neither a file nor a folder, before the model is built or trained (the
    verbs call this first: a typo was reported only after that work).

    Example:
        >>> check_calibration_path("no_such_calib.pt", "--calib-data")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --calib-data 'no_such_calib.pt' does not exist; save the model's inputs only (no labels) with torch.save: a tensor (N, ...), a list of batch tensors, a list of per-batch tuples [(input_ids, attention_mask), ...], or a dict of name -> tensor (N, ...) / a list of such dicts; or give a folder of images (an image model) or a .txt file, one sample per line
    """
    if not Path(path).is_dir() and not Path(path).is_file():
        raise UsageError(f"{flag} {path!r} does not exist; {FORMAT}")


def _read(path: str, flag: str) -> Any:
    """The file's contents: ``torch.load(weights_only=True)``, or for ``.npy`` / ``.npz`` NumPy's reader with
    ``allow_pickle=False`` (an ``.npy`` array is a tensor (N, ...), an ``.npz`` archive a dict of name -> (N, ...))."""
    if Path(path).suffix.lower() in (".npy", ".npz"):
        import numpy as np

        try:
            loaded = np.load(path, allow_pickle=False)
            if isinstance(loaded, np.ndarray):
                return _from_numpy(path, flag, "the array", loaded)
            with loaded:  # an NpzFile: arrays by name, read lazily from the archive
                return {k: _from_numpy(path, flag, f"array {k!r}", loaded[k]) for k in loaded.files}
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - object arrays (need pickle), truncated, not a NumPy file
            why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise UsageError(f"{flag} {path!r} is not a NumPy file overdrive can read safely ({type(exc).__name__}: "
                             f"{why}); save numeric arrays with np.save / np.savez (no object arrays), or {FORMAT}") from exc
    _refuse_model_file(path, flag)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a pickle of objects weights_only refuses, or not a torch file
        raise UsageError(f"{flag} {path!r} is not a tensor file overdrive can read safely ({type(exc).__name__}); "
                         f"{FORMAT} (or an .npy / .npz file)") from exc


def _refuse_model_file(path: str, flag: str) -> None:
    """A model or engine given as calibration data (``--calib-data model.onnx``): say what the file is, before
    torch.load says only that it could not unpickle it."""
    from overdrive.engine.format import MAGIC, model_file_kind

    with open(path, "rb") as f:
        engine = f.read(len(MAGIC)) == MAGIC
    what = "an overdrive engine" if engine else {
        "onnx": "an ONNX model", "torchscript": "a TorchScript module (torch.jit.save)",
        "exported": "a torch.export archive"}.get(model_file_kind(path) or "")
    if what:
        raise UsageError(f"{flag} {path!r} is {what}, not calibration data: {flag} takes the model's sample "
                         f"inputs; {FORMAT}")


TOKENIZED_KEYS = ("ids", "offsets")
"""The arrays of ``overdrive data tokenize -o FILE.npz`` (:meth:`overdrive.data.TokenizedTexts.save`)."""


def _is_tokenized(data: Any) -> bool:
    return (isinstance(data, Mapping) and sorted(data) == sorted(TOKENIZED_KEYS)
            and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in data.values()))


def _from_tokenized(path: str, flag: str, data: Mapping[str, torch.Tensor], model: nn.Module | None,
                    input_names: Sequence[str] | None, input_shape: Sequence[int] | None) -> dict[str, torch.Tensor]:
    """``{"ids", "offsets"}`` (texts stored flat) -> ``{"input_ids": (N, T), "attention_mask": (N, T)}``, padded on
    the right with the model's pad id; the mask only where the model (or the engine's ``input_names``) takes one."""
    import numpy as np

    from overdrive.data import TokenizedTexts

    ids, offsets = data["ids"], data["offsets"]
    off = offsets.to(torch.int64)
    if (ids.is_floating_point() or len(off) < 2 or int(off[0]) != 0 or int(off[-1]) != len(ids)
            or bool((off[1:] < off[:-1]).any())):
        raise UsageError(f"{flag} {path!r} holds 'ids' {tuple(ids.shape)} and 'offsets' {tuple(offsets.shape)} but "
                         "they are not a tokenized corpus (integer ids; offsets from 0 to len(ids), non-decreasing, "
                         "text i = ids[offsets[i]:offsets[i+1]]); write it with overdrive data tokenize -o FILE.npz, "
                         f"or {FORMAT}")
    texts = TokenizedTexts(ids.numpy().astype(np.int32, copy=False), off.numpy())
    lens = texts.lengths()
    if int(lens.max()) == 0:
        raise UsageError(f"{flag} {path!r}: its {len(texts)} tokenized text(s) are all empty; tokenize texts that "
                         "hold words")
    # the sequence length the model is given: (N, T) from --input-shape / --shapes, else the longest text
    seq = int(input_shape[-1]) if input_shape is not None and len(input_shape) == 2 else None
    pad = pad_token_id(model) if model is not None else None
    input_ids, mask = texts.padded(pad_id=pad if pad is not None else 0, max_length=seq, side="right")
    nonempty = torch.from_numpy(lens > 0)  # an empty text is a row of padding only: nothing to attend to
    input_ids, mask = input_ids[nonempty], mask[nonempty]
    if input_names is not None:
        keep_mask = "attention_mask" in input_names
    else:
        keep_mask = model is None or takes_names(model, ["attention_mask"])
    return {"input_ids": input_ids, "attention_mask": mask} if keep_mask else {"input_ids": input_ids}


def _from_numpy(path: str, flag: str, what: str, a: Any) -> torch.Tensor:
    """A NumPy array as a tensor; float64 becomes float32 (the dtype models calibrate in)."""
    import numpy as np

    if a.dtype.kind not in "biuf":
        raise UsageError(f"{flag} {path!r}: {what} has dtype {a.dtype}, not a number or bool; save the model's "
                         "numeric inputs")
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.float() if t.dtype == torch.float64 else t


def _hint(n: int, want: int) -> str:
    if n == 1 and want > 1:
        return (" (a top-level tuple of tensors is read as a list of batches: save [(input_ids, attention_mask)] "
                "for one batch of several inputs, or a dict by name)")
    if n == want + 1:
        return " (labels included? save the inputs only)"
    return ""


def _tuple_names(path: str, flag: str, model: nn.Module | None, n: int) -> list[str] | None:
    """The names a tuple of ``n`` inputs stands for, checked against the model's forward."""
    if model is None:
        return None
    lo, hi = positional_range(model)
    names = default_input_names(model, n)
    if n < lo or (hi is not None and n > hi and names is None):
        want = f"{lo}" if lo == hi else f"{lo} to {hi}" if hi is not None else f"at least {lo}"
        raise UsageError(f"{flag} {path!r}: a batch holds {n} tensor{'s' * (n != 1)} but the model's forward takes "
                         f"{want} input(s) ({type(model).__name__}){_hint(n, lo)}; {FORMAT}")
    return names
