"""Checkpoints that resume bit-identically: model, optimizer, amp (scaler + fp32 masters), RNG."""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from overdrive._utils.errors import UsageError

if TYPE_CHECKING:
    from overdrive.train.loop import Trainer


_TRAILER = b"ODCKSUM1"  # then the sha256 of everything before it


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(path: str | os.PathLike[str], trainer: Trainer, extra: dict[str, Any] | None = None) -> Path:
    """Write the trainer's full state (and RNG) to ``path`` atomically.

    Example:
        >>> # save_checkpoint("ckpt.pt", trainer); load_checkpoint("ckpt.pt", trainer)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": 1, "trainer": trainer.state_dict(), "rng": _rng_state(), "extra": extra or {}}
    from overdrive._utils.files import atomic_write

    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    # a sha256 trailer: a flipped byte anywhere is refused at load instead of loading as another model
    return atomic_write(path, body + _TRAILER + hashlib.sha256(body).digest())  # unique temporary per save


def load_checkpoint(path: str | os.PathLike[str], trainer: Trainer, restore_rng: bool = True) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns its ``extra`` dict."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {str(path)!r} does not exist; pass the path save_checkpoint wrote")
    data = path.read_bytes()
    n = len(_TRAILER) + 32
    if len(data) > n and data[-n:-32] == _TRAILER:
        body = data[:-n]
        if hashlib.sha256(body).digest() != data[-32:]:
            raise UsageError(f"checkpoint {str(path)!r} fails its checksum (corrupted or truncated); use an earlier "
                             "checkpoint or retrain")
    else:
        body = data  # written before checksums (or by torch.save directly): no check is possible
        warnings.warn(f"checkpoint {str(path)!r} has no checksum (an older overdrive wrote it); corruption in it "
                      "cannot be detected", RuntimeWarning, stacklevel=2)
    try:
        payload = torch.load(io.BytesIO(body), map_location=trainer.device, weights_only=True)
    except Exception as exc:
        raise UsageError(f"checkpoint {str(path)!r} could not be read ({type(exc).__name__}: {exc}); is it truncated?") from exc
    if not isinstance(payload, dict) or payload.get("format") != 1:
        raise UsageError(f"{str(path)!r} is not an overdrive checkpoint (format 1)")
    trainer.load_state_dict(payload["trainer"])
    if restore_rng:
        torch.set_rng_state(payload["rng"]["torch"].cpu())
        if "cuda" in payload["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in payload["rng"]["cuda"]])
    return payload["extra"]
