"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes its own shards.

What is saved: model and optimizer (FSDP2 DTensor shards as shards; DDP's replicated tensors once),
amp state (loss scaler; fp32 masters under O2), every rank's RNG states, the loop counters and a
``position`` dict for the data loader (e.g. :class:`overdrive.distributed.ResumableSampler`).
DCP re-shards on load, so a checkpoint written by N ranks loads with M ranks; RNG states are
restored only where the rank existed.

Layout: ``root/step_00000012/`` one DCP directory per save; DCP writes ``.metadata`` last, so a
directory with it is complete, and :func:`latest` ignores half-written ones (a crash mid-save).
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from overdrive._utils.errors import UsageError

if TYPE_CHECKING:
    from overdrive.train.loop import Trainer

_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory under ``root`` (or None).

    Example:
        >>> latest("/nonexistent") is None
        True
    """
    root = Path(root)
    if not root.is_dir():
        return None
    done = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()]
    return max(done)[1] if done else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _is_fsdp(trainer: Trainer) -> bool:
    return trainer.parallel is not None and trainer.parallel.strategy.kind == "fsdp"


def _blob(obj: Any) -> bytes:
    # Replicated optimizer state (no FSDP) travels as one serialized object: a fresh optimizer
    # has no state entries for DCP to load into in place, and under O2 its params are the amp
    # masters, which DCP's get_state_dict cannot name. DCP stores it once (ranks deduplicated).
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _state(trainer: Trainer) -> dict[str, Any]:
    if _is_fsdp(trainer):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    else:
        model_sd, optim_sd = trainer.model.state_dict(), _blob(trainer.optimizer.state_dict())
    amp = trainer.mp.state_dict()
    if "master_params" in amp:
        amp["master_params"] = {str(i): t for i, t in enumerate(amp["master_params"])}
    return {
        "model": model_sd,
        "optim": optim_sd,
        "amp": amp,
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else {},
        "loop": {"epoch": trainer.epoch, "step": trainer.step_count, "micro": trainer._micro},
    }


def save(root: str | os.PathLike[str], trainer: Trainer, position: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write ``trainer``'s state to ``root/step_<step>/`` on every rank (collective); keep the ``keep`` newest.

    Example:
        >>> # path = overdrive.distributed.checkpoint.save("ckpt", trainer, position=sampler.state_dict())
    """
    import torch.distributed.checkpoint as dcp

    if keep < 1:
        raise UsageError(f"keep={keep} must be >= 1")
    root = Path(root)
    path = root / f"step_{trainer.step_count:08d}"
    state = _state(trainer)
    state["rng"] = {f"rank{_rank()}": _rng_state()}
    state["position"] = dict(position or {})
    if _rank() == 0 and path.exists():  # an incomplete earlier attempt at this step
        shutil.rmtree(path)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, checkpoint_id=str(path))
    if _rank() == 0:
        done = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / ".metadata").is_file())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load(path: str | os.PathLike[str], trainer: Trainer, restore_rng: bool = True) -> dict[str, Any]:
    """Restore what :func:`save` wrote into ``trainer`` (any rank count); returns the ``position`` dict.

    Example:
        >>> # ckpt = latest("ckpt"); position = load(ckpt, trainer) if ckpt else {}
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise UsageError(f"{str(path)!r} is not a complete DCP checkpoint (no .metadata); use checkpoint.latest(root)")
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    keys = set(meta.state_dict_metadata)
    state = _state(trainer)
    rng_key = f"rank{_rank()}"
    have_rng = restore_rng and any(k.startswith(f"rng.{rng_key}.") for k in keys)
    if have_rng:
        state["rng"] = {rng_key: _rng_state()}
    state["position"] = {k.split(".", 1)[1]: None for k in keys if k.startswith("position.")}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as exc:
        raise UsageError(f"checkpoint {str(path)!r} does not fit this trainer ({type(exc).__name__}: {exc})") from exc
    if _is_fsdp(trainer):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(_unblob(state["optim"]))
    amp = state["amp"]
    if "master_params" in amp:
        amp["master_params"] = [amp["master_params"][str(i)] for i in range(len(amp["master_params"]))]
    trainer.mp.load_state_dict(amp)
    if trainer.scheduler is not None and state["scheduler"]:
        trainer.scheduler.load_state_dict(state["scheduler"])
    loop = state["loop"]
    trainer.epoch, trainer.step_count, trainer._micro = int(loop["epoch"]), int(loop["step"]), int(loop["micro"])
    if have_rng:
        torch.set_rng_state(state["rng"][rng_key]["cpu"])
        if "cuda" in state["rng"][rng_key] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"][rng_key]["cuda"])
    return state["position"]
