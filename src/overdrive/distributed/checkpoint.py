"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes its own shards.

What is saved: model and optimizer (FSDP2 DTensor shards as shards; DDP's replicated tensors once),
amp state (loss scaler; fp32 masters under O2), every rank's RNG states, the loop counters, each
rank's pending gradients when saved mid-accumulation (not under FSDP2, see :func:`save`), and a
``position`` dict for the data loader (e.g. :class:`overdrive.distributed.ResumableSampler`),
returned by :func:`load` as it was given. DCP re-shards on load, so a checkpoint written by N ranks
loads with M ranks, and one written under DDP loads under FSDP2 and back (O0/O1: the optimizer
state is stored by parameter name for both); RNG states are restored only where the rank existed.

Layout: ``root/step_00000012/`` one DCP directory per save: ``.metadata``, one ``__<rank>_0.distcp``
shard file per rank, and ``overdrive.manifest.json`` (size and sha256 of every other file), written
last, atomically, so its presence marks a complete save. :func:`load` checks every file against it
before DCP reads anything, and never runs a pickle (see :mod:`overdrive.distributed.checkpoint_files`);
:func:`latest` returns the newest folder that verifies, warning with the names of those it skips.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive.distributed import checkpoint_files as files

if TYPE_CHECKING:
    from overdrive.train.loop import Trainer

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _steps(root: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def latest(root: str | os.PathLike[str], check_hashes: bool = True, allow_unverified: bool = False) -> Path | None:
    """The newest checkpoint directory under ``root`` that verifies (or None).

    Newer ones that do not (a save that did not finish, a missing or truncated shard, a checksum
    mismatch, no manifest) are skipped, with a RuntimeWarning naming each and why.
    ``check_hashes=False`` checks that every file is there with its size, not its sha256 (fast on
    large checkpoints; :func:`load` still checks every hash). ``allow_unverified=True`` also returns
    a folder with no manifest (written by an overdrive before checksums), with a warning.

    Example:
        >>> latest("/nonexistent") is None
        True
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        # a resume that read None here started training from scratch, with the checkpoints left unused
        raise UsageError(f"checkpoint.latest({str(root)!r}): that is a file, not a checkpoint root; pass the folder "
                         "that save() writes step_<n> folders into")
    if not root.is_dir():
        return None
    if _STEP_DIR.match(root.name) and not _steps(root):
        raise UsageError(f"checkpoint.latest({str(root)!r}): that is one checkpoint, not a checkpoint root; pass its "
                         f"parent {str(root.parent)!r}, or load({str(root)!r}, ...) to load this one")
    skipped, found, note = [], None, ""
    for _, p in reversed(_steps(root)):
        try:
            files.verify(p, check_hashes=check_hashes, allow_unverified=allow_unverified, warn=False)
        except files.CheckpointFolderError as exc:
            skipped.append(f"{p.name} ({exc.problem})")
            continue
        found = p
        if not (p / files.MANIFEST).is_file():
            note = (f"; {p.name} has no {files.MANIFEST}: it is returned unverified, and corruption in it "
                    "cannot be detected")
        break
    if skipped or note:
        warnings.warn(f"checkpoint.latest({str(root)!r}): "
                      + (f"skipped {'; '.join(skipped)}; " if skipped else "")
                      + (f"returning {found.name}" if found is not None else "no checkpoint verifies") + note,
                      RuntimeWarning, stacklevel=2)
    return found


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _is_fsdp(trainer: Trainer) -> bool:
    return trainer.parallel is not None and trainer.parallel.strategy.kind == "fsdp"


def _named_optim(trainer: Trainer) -> bool:
    """Whether the optimizer steps the model's own parameters (FSDP2; DDP or none at O0/O1/O3).

    Then the optimizer state is saved by parameter name (DCP's ``get_state_dict``), the same for
    both strategies, so a checkpoint moves between DDP and FSDP2. Under O2 (not FSDP2) it steps
    amp's fp32 masters, which ``get_state_dict`` cannot name: it is saved whole (:func:`_blob`).
    """
    mine = {id(q) for q in trainer.model.parameters()}
    return all(id(q) in mine for q in trainer.mp.master_params())


def _get_optim(trainer: Trainer, with_state: bool = True) -> dict[str, Any]:
    """``get_state_dict``'s optimizer state by parameter name, leaving ``trainer`` as it was.

    ``get_state_dict`` creates the state of an optimizer that has not stepped by stepping it once
    with zero gradients and lr 0 (Adam's step count becomes 1, which changed the run that saved).
    Here the trainer's gradients and pending overflow skip are kept aside while it does, and a
    fresh optimizer is left fresh. ``with_state=False`` returns no state entries (what a fresh
    optimizer saves); True, placeholders for every entry (what a load into a fresh one needs).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    opt, mp = trainer.optimizer, trainer.mp
    fresh = len(opt.state) == 0
    params = list(mp.master_params())
    grads = [q.grad for q in params]
    skip = mp.pending_skips()
    for q in params:
        q.grad = None
    try:
        _, optim_sd = get_state_dict(trainer.model, opt)
    finally:
        for q, g in zip(params, grads):
            q.grad = g
        mp.set_pending_skips(skip)
        if fresh:
            opt.state.clear()
    if not with_state:
        optim_sd["state"] = {}
    return optim_sd


_OPTIM_KIND = {
    True: "by parameter name (strategy='fsdp', or 'ddp'/none at O0/O1/O3)",
    False: "as one object (strategy='ddp'/none at O2, where it steps amp's fp32 masters; or saved by an earlier overdrive)",
}


class _AmpMismatch(Exception):
    pass


def _strategy(trainer: Trainer) -> str:
    return trainer.parallel.strategy.kind if trainer.parallel is not None else "none"


def _blob(obj: Any) -> bytes:
    # Optimizer state over amp's O2 masters (no FSDP) travels as one serialized object: DCP's
    # get_state_dict cannot name the masters. DCP stores it once (ranks deduplicated).
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _entry(path: Path, key: str, data: Any) -> Any:
    """A serialized entry of the checkpoint at ``path``, or the error that names it."""
    try:
        if not isinstance(data, bytes):
            raise TypeError(f"a {type(data).__name__}, not the bytes overdrive stores")
        return _unblob(data)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, the finding is the same
        raise files.CheckpointFolderError(
            path, f"entry {key!r} is not what overdrive writes: torch.load(weights_only=True) refuses it "
                  f"({type(exc).__name__}: {_first_line(exc)[:200]}), and nothing in it ran",
            "load only checkpoints that your own runs wrote") from None


def _mid_accumulation(trainer: Trainer) -> bool:
    return trainer.micro_step % trainer.accumulate != 0


def _position_blob(position: dict[str, Any] | None) -> bytes:
    """``position`` as one serialized object, checked to load back.

    DCP would flatten a nested dict into dotted keys and needs a preallocated tensor to load each
    tensor into, so the dict travels whole; checking the round trip here makes an unloadable value
    fail at save time, not at the resume.
    """
    if position is None:
        position = {}
    if not isinstance(position, dict):
        raise UsageError(f"position={type(position).__name__}: expected a dict (e.g. sampler.state_dict()) or None")
    try:
        data = _blob(dict(position))  # a lambda, a generator, an open file: pickling fails here
        _unblob(data)
    except Exception as exc:
        raise UsageError(
            f"position holds a value torch.load(weights_only=True) cannot restore ({type(exc).__name__}: "
            f"{_first_line(exc)}); keep it to dicts, lists, tuples, numbers, strings and tensors"
        ) from exc
    return data


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _why(exc: BaseException) -> str:
    """One short line per failing rank: CheckpointException's str holds every rank's whole traceback."""
    if isinstance(exc, CheckpointException):
        parts = []
        for r, failure in sorted(exc.failures.items()):
            err = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {r}: {type(err).__name__}: {_first_line(err)}")
        return "; ".join(parts) or _first_line(exc)
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _state(trainer: Trainer, optim_state: bool | None = None) -> dict[str, Any]:
    """What DCP saves, or the placeholders it loads into. ``optim_state``: whether the optimizer
    state entries are included (default: whether the optimizer has stepped)."""
    if optim_state is None:
        optim_state = len(trainer.optimizer.state) > 0
    if _is_fsdp(trainer):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, _ = get_state_dict(trainer.model, [])
    else:
        model_sd = trainer.model.state_dict()
    optim_sd: Any = _get_optim(trainer, optim_state) if _named_optim(trainer) else _blob(trainer.optimizer.state_dict())
    amp = trainer.mp.state_dict()
    if "master_params" in amp:
        amp["master_params"] = {str(i): t for i, t in enumerate(amp["master_params"])}
    return {
        "model": model_sd,
        "optim": optim_sd,
        "amp": amp,
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else {},
        "loop": {"epoch": trainer.epoch, "step": trainer.step_count, "micro": trainer.micro_step},
    }


def save(root: str | os.PathLike[str], trainer: Trainer, position: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write ``trainer``'s state to ``root/step_<step>/`` on every rank (collective); keep the ``keep`` newest.

    ``position`` (one copy is stored: make it the same on every rank, as a
    :class:`~overdrive.distributed.ResumableSampler`'s global count is) comes back from :func:`load`
    unchanged. Mid-accumulation, each rank's pending gradients are saved too (DDP accumulates them
    locally until the last micro-batch), so the resume equals an uninterrupted run; under FSDP2 a
    save mid-accumulation is refused (FSDP2 keeps those gradients unsharded in its private state).

    Example:
        >>> # path = overdrive.distributed.checkpoint.save("ckpt", trainer, position=sampler.state_dict())
    """
    import torch.distributed.checkpoint as dcp

    if keep < 1:
        raise UsageError(f"keep={keep} must be >= 1")
    mid = _mid_accumulation(trainer)
    if mid and _is_fsdp(trainer):
        # _micro is the same on every rank, so every rank raises here, before any collective.
        raise UsageError(
            f"checkpoint.save after micro-batch {trainer.micro_step % trainer.accumulate} of accumulate={trainer.accumulate} "
            "under strategy='fsdp': FSDP2 holds the partial gradients unsharded in its private state, which cannot be "
            "saved; save after the train_step that steps the optimizer (when trainer.step_count has just increased)"
        )
    position_blob = _position_blob(position)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # one copy is stored, whichever rank's survives DCP's de-duplication: ranks that pass different positions
        # resumed at another rank's (silently). Every rank raises, before anything is written
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, hashlib.sha256(position_blob).hexdigest())
        if len(set(digests)) > 1:
            raise UsageError(f"checkpoint.save: the ranks passed different position dicts (rank {_rank()}'s differs "
                             "from another's); one copy is stored, so pass the same on every rank (a "
                             "ResumableSampler's state_dict(), the global step), or keep per-rank state yourself")
    root = Path(root)
    if root.exists() and not root.is_dir():  # DCP would fail on every rank with a CheckpointException (a BaseException)
        raise UsageError(f"checkpoint.save root {str(root)!r} is a file, not a folder; pass a folder (it is created), "
                         "e.g. checkpoint.save('ckpt', trainer)")
    path = root / f"step_{trainer.step_count:08d}"
    state = _state(trainer)
    state["rng"] = {f"rank{_rank()}": _rng_state()}
    state["position"] = position_blob
    if mid:
        # Per rank: under DDP each rank's micro-batch gradients stay local until the last micro-batch.
        state["pending"] = {f"rank{_rank()}": _blob(trainer.mp.pending_state())}
    # Written beside the step folder, then swapped in once sealed: a save over an existing step_<n> (a resumed
    # run saving at the step it loaded) that stops part way leaves the old folder whole. The hidden names do
    # not match step_<n>, so latest() and the pruning never see them.
    stage, old = _staging(path)
    if _rank() == 0:
        for leftover in (stage, old):  # an earlier attempt at this step that did not finish
            if leftover.exists():
                shutil.rmtree(leftover)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, checkpoint_id=str(stage))
    _seal(stage, path, trainer.step_count, keep)
    return path


def _staging(path: Path) -> tuple[Path, Path]:
    """Where a save of ``path`` is written before the swap, and where the folder it replaces waits meanwhile."""
    return path.parent / f".{path.name}.saving", path.parent / f".{path.name}.replaced"


def _swap_in(stage: Path, path: Path) -> None:
    """Put the sealed ``stage`` at ``path``; a folder already there is moved aside first, removed last."""
    _, old = _staging(path)
    if path.exists():
        path.rename(old)  # from here until the next rename (two metadata operations) no step_<n> is there
    stage.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _seal(path: Path, final: Path, step: int, keep: int) -> None:
    """After DCP's save into ``path``: the manifest (each rank hashes a share of the files, rank 0 writes it),
    then rank 0 moves it to ``final`` and prunes; every rank returns once ``final`` is there, or raises what
    rank 0 hit."""
    rank, world = _rank(), _world()
    names = files.data_files(path)  # every rank's shards are written once dcp.save has returned
    mine = files.digests(path, names[rank::world])
    shares: list[Any] = [mine]
    if world > 1:
        shares = [None] * world
        dist.all_gather_object(shares, mine)
    err = None
    if rank == 0:
        try:
            done = {k: v for share in shares for k, v in share.items()}
            done.update(files.digests(path, [n for n in names if n not in done]))  # a rank that listed fewer files
            files.write_manifest(path, done)
            _swap_in(path, final)
            _prune(final.parent, step, keep)
        except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised here
            err = f"checkpoint.save could not finish {str(final)!r} ({type(exc).__name__}: {exc})"
            if world == 1:
                raise OverdriveError(err + "; nothing was written in its place (a checkpoint already there is left as it was)") from exc
    if world > 1:
        box = [err]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise OverdriveError(box[0] + "; nothing was written in its place (a checkpoint already there is left as it was)")


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep the folder just written and the ``keep - 1`` newest older ones that can load (a manifest, or
    an older overdrive's ``.metadata``); remove older folders that cannot (a save that did not finish).
    Newer folders are left alone (a run resumed from before them, e.g. because they were corrupt)."""
    loadable = []
    for s, p in _steps(root):
        if s >= step:
            continue
        if (p / files.MANIFEST).is_file() or (p / files.METADATA).is_file():
            loadable.append(p)
        else:
            shutil.rmtree(p, ignore_errors=True)
    for p in loadable[: max(0, len(loadable) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def _verified(path: Path, allow_unverified: bool) -> bytes:
    """:func:`files.verify` with the shards' hashing split between the ranks; every rank raises the
    same error if any rank found one. Returns the checked bytes of ``.metadata``."""
    rank, world = _rank(), _world()
    err: files.CheckpointFolderError | None = None
    data = b""
    try:
        data = files.verify(path, allow_unverified=allow_unverified, share=(rank, world))
    except files.CheckpointFolderError as exc:
        err = exc
    if world > 1:
        found: list[Any] = [None] * world
        dist.all_gather_object(found, err)
        err = next((e for e in found if e is not None), None)
    if err is not None:
        raise err
    return data


def _refused(exc: BaseException) -> files.RefusedEntry | None:
    if isinstance(exc, files.RefusedEntry):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, files.RefusedEntry):
            return err
    return None


def _names(keys: list[str], most: int = 8) -> str:
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _check_model_keys(path: Path, saved: dict[str, Any], model_sd: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model before DCP reads anything, naming every differing key.

    DCP loads only the keys the trainer asks for: weights the checkpoint has and the model lacks were
    skipped silently (a partial load), and a missing one or a shape mismatch was named one at a time.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved_model = sorted(k[len("model."):] for k in saved if isinstance(k, str) and k.startswith("model."))
    mine = set(model_sd)
    # a non-tensor entry (a module's _extra_state dict) is flattened by DCP into dotted keys under its name
    owner = {k: next((m for m in (k, *(k.rsplit(".", i)[0] for i in range(1, k.count(".") + 1))) if m in mine), None)
             for k in saved_model}
    unexpected = [k for k in saved_model if owner[k] is None]
    missing = sorted(mine - set(owner.values()))
    shapes = []
    for k, v in model_sd.items():
        meta = saved.get(f"model.{k}")
        size = getattr(meta, "size", None) if isinstance(meta, TensorStorageMetadata) else None
        if isinstance(v, torch.Tensor) and isinstance(size, tuple) and tuple(size) != tuple(v.shape):
            shapes.append(f"{k}: saved {tuple(size)}, model {tuple(v.shape)}")
    if missing or unexpected or shapes:
        found = ([f"missing from the checkpoint: {_names(missing)}"] if missing else []) \
            + ([f"in the checkpoint, not in the model: {_names(unexpected)}"] if unexpected else []) \
            + ([f"Size mismatch: {_names(shapes)}"] if shapes else [])
        raise UsageError(f"checkpoint {str(path)!r} does not fit this trainer: it was saved from another model "
                         f"({'; '.join(found)}), and nothing was loaded; load it into a Trainer built with the same "
                         "model (same layers, names and sizes) as the one that saved it")


def load(path: str | os.PathLike[str], trainer: Trainer, restore_rng: bool = True,
         allow_unverified: bool = False) -> dict[str, Any]:
    """Restore what :func:`save` wrote into ``trainer`` (any rank count); returns the ``position`` dict.

    Gradients ``trainer`` holds from before the load are dropped, and a checkpoint saved
    mid-accumulation restores each rank's pending gradients (it needs the rank count it was saved
    with), so the next steps equal an uninterrupted run. A checkpoint saved under strategy='ddp'
    loads under 'fsdp' and the other way round at O0/O1 (the optimizer state is stored by
    parameter name); where it cannot (O2/O3, whose amp state differs between the strategies), a
    UsageError names both, before anything is loaded.

    Before DCP reads anything, every file is checked against the folder's manifest (size and
    sha256; the ranks split the hashing): a missing shard, a truncated file or a flipped byte raises
    a UsageError naming the file. A folder without a manifest (an overdrive before checksums wrote
    it) is refused unless ``allow_unverified=True``. No pickle in the folder runs: ``.metadata`` is
    read by a restricted unpickler, the other entries with ``torch.load(weights_only=True)``.

    Example:
        >>> # ckpt = latest("ckpt"); position = load(ckpt, trainer) if ckpt else {}
    """
    import torch.distributed.checkpoint as dcp

    if path is None:
        raise UsageError("checkpoint.load(None, ...): no checkpoint to load (checkpoint.latest(root) returns None "
                         "when no folder verifies; its warning names the ones it skipped)")
    path = Path(path)
    if path.is_dir() and not (path / files.METADATA).exists() and (inside := _steps(path)):
        # the root that save() writes step folders into: verify would call it "a save that did not finish"
        raise UsageError(f"checkpoint.load({str(path)!r}): that is a checkpoint root holding {len(inside)} step "
                         f"folder(s) ({inside[-1][1].name} the newest), not one checkpoint; pass "
                         f"checkpoint.latest({str(path)!r}), the newest one that verifies")
    meta_bytes = _verified(path, allow_unverified)
    saved_meta = files.read_metadata(path, meta_bytes).state_dict_metadata
    keys = set(saved_meta)
    world = _world()
    pending_ranks = sorted(int(k[len("pending.rank"):]) for k in keys if k.startswith("pending.rank"))
    if pending_ranks and pending_ranks != list(range(world)):
        raise UsageError(
            f"checkpoint {str(path)!r} was saved mid-accumulation on {len(pending_ranks)} rank(s), each with its own "
            f"partial gradients, and this run has {world}; resume it with {len(pending_ranks)} rank(s), or use a "
            "checkpoint saved after an optimizer step"
        )
    # FSDP2 keeps partial gradients unsharded in its private state: they can be neither set nor dropped.
    if _is_fsdp(trainer) and pending_ranks:
        raise UsageError(
            f"checkpoint {str(path)!r} was saved mid-accumulation, with each rank's partial gradients, and this "
            "trainer uses strategy='fsdp', which cannot take them; resume it with the strategy that saved it, or use "
            "a checkpoint saved after an optimizer step"
        )
    if _is_fsdp(trainer) and _mid_accumulation(trainer):
        raise UsageError(
            f"this trainer is at micro-batch {trainer.micro_step % trainer.accumulate} of accumulate={trainer.accumulate} "
            "under strategy='fsdp': FSDP2 would add those partial gradients to the resumed step and they cannot be "
            "dropped; load into a freshly built Trainer, or after a train_step that steps the optimizer"
        )
    saved_named = "optim" not in keys  # by parameter name ('optim.param_groups', ...), not one object
    # A whole optimizer state_dict loads into any trainer whose optimizer holds plain tensors (not FSDP2's
    # shards); one by parameter name needs the optimizer to step the model's own parameters.
    if (saved_named and not _named_optim(trainer)) or (not saved_named and _is_fsdp(trainer)):
        raise UsageError(
            f"checkpoint {str(path)!r} holds the optimizer state {_OPTIM_KIND[saved_named]}, and this trainer "
            f"(strategy={_strategy(trainer)!r}, amp {trainer.mp.policy.opt_level}) needs it "
            f"{_OPTIM_KIND[not saved_named]}; resume it with the strategy and amp policy that saved it "
            "(checkpoints saved at O0/O1 move between strategy='ddp' and 'fsdp' freely)"
        )
    saved_state = any(k.startswith("optim.state.") for k in keys)
    state = _state(trainer, optim_state=saved_state)
    _check_model_keys(path, saved_meta, state["model"])
    if not saved_named:
        state["optim"] = None  # a placeholder DCP replaces with the saved bytes
    me = f"rank{_rank()}"
    have_rng = restore_rng and any(k.startswith(f"rng.{me}.") for k in keys)
    if have_rng:
        state["rng"] = {me: _rng_state()}
    legacy_position = "position" not in keys  # written before position was stored whole: flat, dotted keys
    if legacy_position:
        state["position"] = {k.split(".", 1)[1]: None for k in keys if k.startswith("position.")}
    else:
        state["position"] = None  # a placeholder DCP replaces with the saved bytes
    if pending_ranks:
        state["pending"] = {me: None}  # a placeholder DCP replaces with this rank's saved bytes
    try:
        if "amp.opt_level" in keys:
            # Read first: DCP loads the model in place, so a mismatch found afterwards would leave it
            # half-restored. FSDP2 runs O2/O3 bf16 as FSDP mixed precision with amp at O0, so the amp
            # level differs between strategies there.
            head: dict[str, Any] = {"amp": {"opt_level": None}}
            dcp.load(head, storage_reader=files.SafeReader(path, meta_bytes), planner=files.SafePlanner())
            if head["amp"]["opt_level"] != trainer.mp.policy.opt_level:
                raise _AmpMismatch(head["amp"]["opt_level"])
        dcp.load(state, storage_reader=files.SafeReader(path, meta_bytes), planner=files.SafePlanner())
    except _AmpMismatch as exc:
        raise UsageError(
            f"checkpoint {str(path)!r} holds amp state at opt level {exc.args[0]!r} and this trainer "
            f"(strategy={_strategy(trainer)!r}) runs amp at {trainer.mp.policy.opt_level!r} (strategy='fsdp' runs "
            "O2/O3 bf16 with amp at 'O0', strategy='ddp' with amp at O2/O3); resume it with the strategy and amp policy that saved it"
        ) from None
    except (CheckpointException, Exception) as exc:  # CheckpointException derives from BaseException
        if (bad := _refused(exc)) is not None:
            raise files.CheckpointFolderError(
                path, f"entry {bad.key!r} is not what overdrive writes: torch.load(weights_only=True) refuses it "
                      f"({bad.reason}), and nothing in it ran", "load only checkpoints that your own runs wrote"
            ) from None
        raise UsageError(
            f"checkpoint {str(path)!r} does not fit this trainer ({_why(exc)}); load it into a Trainer built with "
            "the same model, optimizer, amp policy and strategy as the one that saved it"
        ) from exc
    # The serialized entries, unpickled (weights_only) before anything but the model is restored.
    optim_obj = None if saved_named else _entry(path, "optim", state["optim"])
    pending = _entry(path, f"pending.{me}", state["pending"][me]) if pending_ranks else None
    position = state["position"] if legacy_position else _entry(path, "position", state["position"])
    amp = state["amp"]
    if saved_named:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optim_sd = state["optim"]
        if saved_state:
            set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd)
        else:  # saved before its first step: hyperparameters only, and the optimizer stays fresh
            set_state_dict(trainer.model, [], model_state_dict=state["model"], optim_state_dict={})
            for group, saved in zip(trainer.optimizer.param_groups, optim_sd["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            trainer.optimizer.state.clear()
    else:
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(optim_obj)
    if "master_params" in amp:
        amp["master_params"] = [amp["master_params"][str(i)] for i in range(len(amp["master_params"]))]
    trainer.mp.load_state_dict(amp)
    if trainer.scheduler is not None and state["scheduler"]:
        trainer.scheduler.load_state_dict(state["scheduler"])
    loop = state["loop"]
    trainer.epoch, trainer.step_count, trainer.micro_step = int(loop["epoch"]), int(loop["step"]), int(loop["micro"])
    # Gradients (and a pending overflow skip) this trainer holds from before the load would leak into
    # the resumed step: drop them, then put back the checkpoint's own pending ones, if any.
    trainer.mp.zero_grad()
    if pending is None:
        pending = trainer.mp.pending_state()  # every gradient is None after zero_grad: nothing is copied
        pending["skip"] = []
    trainer.mp.load_pending_state(pending)
    if have_rng:
        torch.set_rng_state(state["rng"][me]["cpu"])
        if "cuda" in state["rng"][me] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"][me]["cuda"])
    return position
