"""The fp32 math an engine pins: TF32 or IEEE fp32 on cuBLAS, cuDNN and oneDNN, set around every build and call.

An engine records the flags it was built under (``backend_meta["fp32_precision"]``); its runner sets them at each
call and puts the caller's back after, so neither the caller's ``torch.set_float32_matmul_precision`` nor torch's
defaults change an engine's numerics, and the engine cannot change the caller's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from overdrive._utils.errors import UsageError

# The fp32 math an engine pins while it compiles and runs, keyed as torch.backends.<key>.fp32_precision names it
# (cuBLAS matmuls, cuDNN convolutions and RNNs, oneDNN's CPU matmuls, convolutions and RNNs), with torch's
# (backend, op) slot for each. A slot set to "none" reads through to its backend's "all" slot, that one to "generic".
_FP32_KEYS = {"cuda.matmul": ("cuda", "matmul"), "cudnn.conv": ("cuda", "conv"), "cudnn.rnn": ("cuda", "rnn"),
              "mkldnn.matmul": ("mkldnn", "matmul"), "mkldnn.conv": ("mkldnn", "conv"), "mkldnn.rnn": ("mkldnn", "rnn")}
_GENERIC, _ALL = ("generic", "all"), {"cuda": ("cuda", "all"), "mkldnn": ("mkldnn", "all")}
_SLOTS = (_GENERIC, *_ALL.values(), *_FP32_KEYS.values())  # parents first
_CONV_RNN = (("cuda", "conv"), ("cuda", "rnn"))
# what torch.backends.<...>.fp32_precision reads and writes, by (backend, op)
_get_fp32, _set_fp32 = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter


def fp32_flags(precision: str, allow_tf32: bool = True) -> dict[str, str]:
    """The fp32 math an engine of ``precision`` runs, recorded in its header (``backend_meta["fp32_precision"]``):
    TF32 on cuBLAS and cuDNN for 'tf32' and for the fp32 leftovers of fp16/bf16/int8/fp8, IEEE fp32 for 'fp32' and,
    with ``allow_tf32`` False (``BuildConfig.allow_tf32``, trtexec's ``--noTF32``), for those leftovers too;
    IEEE on the CPU (oneDNN) for all, so a caller's ``set_float32_matmul_precision("medium")`` cannot turn an fp32
    CPU engine's matmuls into bf16 ones.

    Example:
        >>> fp32_flags("fp32")["cuda.matmul"], fp32_flags("fp16")["cudnn.conv"], fp32_flags("tf32")["mkldnn.matmul"]
        ('ieee', 'tf32', 'ieee')
        >>> fp32_flags("fp16", allow_tf32=False) == fp32_flags("fp32")
        True
    """
    if precision == "tf32" and not allow_tf32:
        raise UsageError("precision 'tf32' with allow_tf32=False (--noTF32) asks for opposite fp32 math; give "
                         "precision 'fp32' for IEEE fp32, or drop allow_tf32=False")
    gpu = "ieee" if precision == "fp32" or not allow_tf32 else "tf32"
    return {k: gpu if b == "cuda" else "ieee" for k, (b, _) in _FP32_KEYS.items()}


_FP32_CHOICES = (fp32_flags("fp32"), fp32_flags("tf32"))


def check_fp32_flags(flags: Any) -> dict[str, str]:
    if flags not in _FP32_CHOICES:
        raise UsageError(f"the engine header's backend_meta.fp32_precision is {flags!r}; this overdrive runs "
                         f"{_FP32_CHOICES[0]} or {_FP32_CHOICES[1]}: rebuild the engine")
    return flags


def _as_set(slot: tuple[str, str], parent: tuple[str, str], read: dict[tuple[str, str], str],
            parent_as_set: str) -> str:
    """What ``slot`` was set to, "none" (inherit) included: the getter answers a "none" slot with its parent's value,
    so one that reads like its parent (and not "none") is told apart by setting the parent to another value for a
    moment. (torch 2.13's untouched cuDNN conv/rnn default reads "tf32" under an unset parent: taken as "tf32".)"""
    value = read[slot]
    if value == "none" or value != read[parent]:
        return value
    probe = "ieee" if value != "ieee" else "tf32"
    _set_fp32(*parent, probe)
    follows = _get_fp32(*slot) == probe
    _set_fp32(*parent, parent_as_set)
    return "none" if follows else value


@contextlib.contextmanager
def precision_flags(flags: dict[str, str]) -> Iterator[None]:
    """Run the block with the engine's fp32 math ``flags`` (one of :func:`fp32_flags`), then put the caller's flags
    back as they were, also on an exception. About 20 plain attribute reads and writes per use.

    Each backend's "all" slot (Inductor reads those too) and both matmul slots are set to the engine's value, and
    the other per-op slots where they do not inherit it already; each is put back after ("none" again where it
    inherited). The legacy views, ``torch.get_float32_matmul_precision()`` and ``torch.backends.cudnn.allow_tf32``,
    are moved in step where they disagree, since torch raises ("a mix of the legacy and new APIs") otherwise: at
    every CUDA matmul, in Inductor and in torch.export. The cuDNN one's setter writes conv/rnn, which torch 2.13
    starts in an internal "untouched default" that no setter can put back (torch.export's own flag restore
    overwrites it too): where it must move (an fp32 engine under torch's defaults) they come back reading as before.

    Example:
        >>> with precision_flags(fp32_flags("tf32")):
        ...     torch.backends.cuda.matmul.fp32_precision
        'tf32'
    """
    flags = check_fp32_flags(flags)
    undo: list[tuple[tuple[str, str], str]] = []  # (slot, value as the caller set it), put back last to first
    matmul = cudnn = None  # the caller's legacy values, where they had to move
    try:
        read = {s: _get_fp32(*s) for s in _SLOTS}
        legacy: list[Any] = []
        for get in (torch.get_float32_matmul_precision, lambda: torch.backends.cudnn.allow_tf32):
            try:
                legacy.append(get())
            except RuntimeError:  # the caller's slots disagree with it: read again once they agree
                legacy.append(None)
        was = {_GENERIC: read[_GENERIC]}  # the root reads as set
        for slot in _SLOTS[1:]:
            parent = _GENERIC if slot[1] == "all" else _ALL[slot[0]]
            was[slot] = _as_set(slot, parent, read, was[parent])
        for backend, parent in _ALL.items():
            want = flags["cuda.matmul" if backend == "cuda" else "mkldnn.matmul"]  # one value per backend
            if read[parent] != want:
                undo.append((parent, was[parent]))
                _set_fp32(*parent, want)
        for key, slot in _FP32_KEYS.items():
            # matmul slots always: torch.export sets the "all" slots to "none" while it traces, and the legacy
            # matmul precision must agree with both; the others where they neither inherit nor hold the value
            if slot[1] == "matmul" or (was[slot] != "none" and was[slot] != flags[key]):
                undo.append((slot, was[slot]))
                _set_fp32(*slot, flags[key])
        tf32 = flags["cuda.matmul"] == "tf32"
        if legacy[0] is None:  # with the slots above, the one disagreement left: a TF32 slot against 'highest'
            _set_fp32("cuda", "matmul", "ieee")
            legacy[0] = torch.get_float32_matmul_precision()
            _set_fp32("cuda", "matmul", flags["cuda.matmul"])
        if (legacy[0] != "highest") != tf32:
            matmul = legacy[0]
            torch.backends.cuda.matmul.allow_tf32 = tf32  # 'high' or 'highest', and the cuda.matmul slot as flags say
        tf32 = flags["cudnn.conv"] == "tf32"
        if legacy[1] is None:
            try:  # conv and rnn agree now: it raises only where it differs from them
                legacy[1] = torch.backends.cudnn.allow_tf32
            except RuntimeError:
                legacy[1] = not tf32
        if legacy[1] != tf32:
            cudnn = legacy[1]
            undo += [(s, was[s]) for s in _CONV_RNN]
            torch.backends.cudnn.allow_tf32 = tf32  # writes conv and rnn: TF32, or "none" (they follow cuda's slot)
        yield
    finally:
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)  # this writes both matmul slots: they are put back below
        if cudnn is not None:
            torch.backends.cudnn.allow_tf32 = cudnn  # this writes conv and rnn: put back below
        for slot, value in reversed(undo):
            _set_fp32(*slot, value)
