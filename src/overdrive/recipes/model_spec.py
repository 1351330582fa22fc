"""What ``--model`` and ``--calib`` mean for every verb: model specs (with the demo's aliases) and
calibration files, read one way (``torch.load(weights_only=True)``: a data file never runs code; the format
and its reader, :func:`load_calibration`, live in :mod:`overdrive.recipes.calibration`).

Example:
    >>> type(load_model("digits")).__name__
    'DigitsCNN'
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError, did_you_mean
from overdrive._utils.model_spec import load_factory
from overdrive.recipes.calibration import Calibration, load_calibration

__all__ = ["ALIASES", "Calibration", "load_calibration", "load_checkpoint", "load_model"]

# Short names for the models that ship with overdrive (the demo's and the text task's).
ALIASES = {"digits": "overdrive.recipes.models:DigitsCNN", "docstrings": "overdrive.recipes.textdata:ByteTransformer"}


def load_model(spec: str, flag: str = "--model") -> nn.Module:
    """An alias (``digits``, ``docstrings``), ``pkg.module:factory`` or ``file.py:factory`` -> a fresh model."""
    if spec not in ALIASES:
        _refuse_model_file(spec, flag)
    if ":" not in spec and spec not in ALIASES:
        raise UsageError(f"{flag} {spec!r} must be 'package.module:factory', 'path/to/file.py:factory' or one of "
                         f"{', '.join(sorted(ALIASES))}{_spec_hint(spec)}")
    return load_factory(ALIASES.get(spec, spec), flag)


# the build flag that takes each kind of model file, and what the file is (engine.format.model_file_kind's kinds)
_MODEL_FILES = {"onnx": ("an ONNX model", "--onnx"), "torchscript": ("a TorchScript module (torch.jit.save)", "--torchscript"),
                "exported": ("a torch.export archive", "--exported")}


def _refuse_model_file(spec: str, flag: str) -> None:
    """A model file given where a factory goes (``--model mlp.onnx``, ``--model model.pt``): say what it is and the
    flag that takes it, instead of a factory spec's syntax error."""
    from overdrive.engine.format import MAGIC, model_file_kind

    path = Path(spec)
    if not path.is_file():
        kind = {".onnx": "onnx", ".pt2": "exported", ".engine": "engine"}.get(path.suffix.lower())
        if kind is None:
            return
    else:
        with open(path, "rb") as f:
            kind = "engine" if f.read(len(MAGIC)) == MAGIC else model_file_kind(path)
    if kind == "engine":
        raise UsageError(f"{flag} {spec!r} {'is' if path.is_file() else 'names'} an overdrive engine, not a PyTorch model factory; run it with "
                         f"overdrive exec --loadEngine {spec}, or give {flag} 'file.py:factory' that builds the model")
    if kind in _MODEL_FILES:
        what, build_flag = _MODEL_FILES[kind]
        is_ = "is" if path.is_file() else "names"  # a missing file: its suffix says what it would be
        raise UsageError(f"{flag} {spec!r} {is_} {what}, not a PyTorch model factory ({flag} takes 'file.py:factory' or "
                         f"'package.module:factory'); build an engine from it with overdrive build {build_flag} {spec}")
    if kind == "torch.save" or (path.is_file() and path.suffix.lower() in (".pt", ".pth", ".bin", ".ckpt")):
        raise UsageError(f"{flag} {spec!r} is a pickled file; overdrive does not unpickle models (loading a pickle "
                         "runs code). Give 'file.py:factory' that builds the model, and its weights as a state_dict "
                         "where the verb takes --checkpoint")


def _spec_hint(spec: str) -> str:
    """The end of the message for a spec with no ':': the alias it may misspell, or for a ``.py`` file the
    factories it defines (read from its syntax tree, nothing run)."""
    if not spec.endswith(".py"):
        return did_you_mean(spec, ALIASES, what="aliases", list_up_to=0)
    import ast

    try:
        tree = ast.parse(Path(spec).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return f"; name the factory in {spec}: '{spec}:make_model'"
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
    if not names:
        return f"; {spec} defines no function or class at its top level to build the model with"
    shown = ", ".join(f"'{spec}:{n}'" for n in names[:4])
    return f"; name the factory in {spec}: {shown}{' ...' if len(names) > 4 else ''}"


def load_checkpoint(model: nn.Module, path: str | os.PathLike[str], flag: str = "--checkpoint") -> None:
    """Load weights into ``model``, read weights-only: a plain state_dict, a {'model'/'state_dict': ...} dict, an
    overdrive Trainer checkpoint, or a 2:4 compressed checkpoint (``overdrive sparsify --out``, ``.sparse24.pt``),
    whose pruned weights come back dense (zeros in place) on a plain float model.

    Example:
        >>> # load_checkpoint(load_model("mypkg.models:build"), "model.sparse24.pt")
    """
    check_checkpoint_path(path, flag)
    kind = _other_format(path)
    if kind is not None:  # named before torch.load, which says only what it could not unpickle
        raise UsageError(f"{flag} {str(path)!r} is {kind}, not weights; give a file written by "
                         "torch.save(model.state_dict(), path) (or a .safetensors file)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" in str(exc):  # objects a weights-only load refuses: a whole model, a custom class
            raise UsageError(f"{flag} {str(path)!r} holds pickled Python objects (a whole model saved with "
                             "torch.save(model), or a class of your own inside the dict); overdrive reads weights only "
                             "(loading a pickle runs code): re-save it with torch.save(model.state_dict(), path)") from exc
        raise UsageError(f"{flag} {str(path)!r} is not a torch.save file of weights; give a file written by "
                         "torch.save(model.state_dict(), path) (or a .safetensors file)") from exc
    except Exception as exc:  # not a torch.save file, truncated
        why = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
        why = why.splitlines()[0] if why else ""
        raise UsageError(f"{flag} {str(path)!r} cannot be read as weights ({type(exc).__name__}: {why[:200]}); give "
                         "a file written by torch.save(model.state_dict(), path)") from exc
    from overdrive.sparsity.export import FORMAT as SPARSE24, load_compressed

    if isinstance(payload, dict) and payload.get("format") == SPARSE24:
        load_compressed(model, path).remove()  # the 2:4 weights, dense; no masks left to carry into a build
        return
    if isinstance(payload, dict) and isinstance(payload.get("trainer"), dict):
        payload = payload["trainer"]
    for key in ("model", "state_dict"):
        if isinstance(payload, dict) and isinstance(payload.get(key), dict):
            payload = payload[key]
    if not isinstance(payload, dict):
        raise UsageError(f"{flag} {path} holds a {type(payload).__name__}, not a state_dict")
    from overdrive.sparsity.api import MASK_SUFFIX

    payload = _strip_wrapper_prefix(model, payload)
    own = {n for n, _ in model.named_buffers()}
    # a state_dict saved from a pruned (fine-tuned) model carries its 2:4 mask buffers; the model built
    # here is dense, and its masks are recomputed from the loaded weights, which are already 2:4
    payload = {k: v for k, v in payload.items() if not (isinstance(k, str) and k.endswith(MASK_SUFFIX) and k not in own)}
    try:
        model.load_state_dict(payload)
    except RuntimeError as exc:  # torch lists the missing / unexpected keys and size mismatches on lines of their own
        lines = [ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()] or [str(exc).strip()]
        detail = "; ".join(lines)
        raise UsageError(f"{flag} {path} does not fit the model: "
                         f"{detail[:400] + ' ...' if len(detail) > 400 else detail}") from exc


WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


def check_checkpoint_path(path: str | os.PathLike[str], flag: str = "--checkpoint") -> None:
    """Refuse a checkpoint path that is not a file: missing, or a folder (a ``save_pretrained`` or run directory),
    naming the weight files the folder holds."""
    p = Path(path)
    if p.is_dir():
        found = sorted(f.name for f in p.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
        hint = (f"it holds {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}: give one, e.g. "
                f"{flag} {str(p / found[0])!r}" if found else
                f"it holds no weight file ({', '.join(WEIGHT_SUFFIXES)})")
        raise UsageError(f"{flag} {str(path)!r} is a folder, not a weights file; {hint}")
    if not p.is_file():
        raise UsageError(f"{flag} {str(path)!r} does not exist")


def _other_format(path: str | os.PathLike[str]) -> str | None:
    """What a file in a format other than torch.save's or safetensors' is (NumPy, TorchScript), from its first
    bytes and its layout (:func:`overdrive.engine.format.model_file_kind`); None for any other file (torch.load says
    what is wrong with it)."""
    from overdrive.engine.format import model_file_kind

    return {"npy": "a NumPy array file (np.save)", "npz": "a NumPy archive (np.savez)",
            "torchscript": "a TorchScript archive (torch.jit.save; its weights: "
                           "torch.save(torch.jit.load(path).state_dict(), 'w.pt'))"}.get(model_file_kind(path) or "")


# What wrappers put before every key: DistributedDataParallel / DataParallel ('module.'), torch.compile ('_orig_mod.')
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _strip_wrapper_prefix(model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without the prefix a DDP / DataParallel / torch.compile wrapper put before every key, when the
    model's own keys do not carry it (a checkpoint saved as ``ddp_model.state_dict()`` from a training script).

    Example:
        >>> _strip_wrapper_prefix(nn.Linear(1, 1), {"module.weight": 1, "module.bias": 2})
        {'weight': 1, 'bias': 2}
    """
    out = dict(state)
    own = set(model.state_dict())
    changed = True
    while changed and out:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            keys = [k for k in out if isinstance(k, str)]
            if (len(keys) == len(out) and all(k.startswith(prefix) for k in keys)
                    and not any(k.startswith(prefix) for k in own)):
                out = {k[len(prefix):]: v for k, v in out.items()}
                changed = True
    return out
