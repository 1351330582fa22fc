"""What a DCP checkpoint folder is trusted with, and how it is checked before DCP reads it.

A folder that :func:`overdrive.distributed.checkpoint.save` wrote holds DCP's ``.metadata`` (a pickle),
one ``__<rank>_<i>.distcp`` shard file per rank, and, written last and atomically,
``overdrive.manifest.json``: the size and sha256 of every other file. Its presence marks a complete
save; :func:`verify` checks every file against it before anything is unpickled or loaded.

Nothing in a folder runs code when it is loaded, manifest or not: ``.metadata`` goes through
:class:`_MetadataUnpickler`, which builds only DCP's metadata classes, ``torch.Size``, dtypes,
layouts and paths (a crafted pickle raises :class:`CheckpointFolderError` instead of running), and
DCP's non-tensor entries load through :class:`SafePlanner` with ``torch.load(weights_only=True)``
(DCP's default planner uses ``weights_only=False``). Tensors DCP loads itself with
``weights_only=True``. The manifest guards integrity (a torn save, a missing shard, a flipped
byte), not authenticity: whoever can write the folder can rewrite the manifest too.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> try:
    ...     verify(d)
    ... except CheckpointFolderError as exc:
    ...     print(exc.problem)
    incomplete: no .metadata and no overdrive.manifest.json (a save that did not finish)
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from overdrive._utils.errors import UsageError
from overdrive._utils.files import atomic_write

MANIFEST = "overdrive.manifest.json"
METADATA = ".metadata"
FORMAT = "overdrive-dcp/1"
_CHUNK = 1 << 20


class CheckpointFolderError(UsageError):
    """A checkpoint folder that is incomplete, corrupt, or holds what DCP never writes.

    ``problem`` is the short reason (what :func:`overdrive.distributed.checkpoint.latest` warns with);
    the message adds the folder and the fix.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, fix: str | None = None) -> None:
        self.path = str(path)
        self.problem = problem
        self.fix = fix or ("use an earlier checkpoint: checkpoint.latest(root) returns the newest one that "
                           "verifies, naming the ones it skips")
        super().__init__(f"checkpoint {self.path!r}: {problem}; {self.fix}")

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # rebuilt from its parts when it travels between ranks
        return (type(self), (self.path, self.problem, self.fix))


# --- the manifest -------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def data_files(path: str | os.PathLike[str]) -> list[str]:
    """The files of a checkpoint folder that the manifest lists: all but the manifest and temporaries."""
    return sorted(p.name for p in Path(path).iterdir()
                  if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def digests(path: str | os.PathLike[str], names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` for ``names`` in ``path``."""
    path = Path(path)
    return {n: {"size": (path / n).stat().st_size, "sha256": _sha256(path / n)} for n in names}


def _files_digest(files: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(path: str | os.PathLike[str], files: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write ``path/overdrive.manifest.json`` atomically (``files``: from :func:`digests`; default: every
    data file of the folder, hashed here). Call it last: its presence marks the save complete."""
    path = Path(path)
    if files is None:
        files = digests(path, data_files(path))
    if METADATA not in files:
        raise CheckpointFolderError(path, f"no {METADATA} to seal (DCP's save did not finish)", "save again")
    body = {"format": FORMAT, "files": files, "digest": _files_digest(files)}
    return atomic_write(path / MANIFEST, json.dumps(body, indent=1, sort_keys=True) + "\n")


def read_manifest(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]] | None:
    """The manifest's ``{name: {"size", "sha256"}}``, None if the folder has none; a damaged one raises."""
    path = Path(path)
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(raw.decode("utf-8"))
        files = body["files"]
        ok = (body["format"] == FORMAT and isinstance(files, dict) and body["digest"] == _files_digest(files)
              and all(isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
                      for e in files.values()))
    except Exception:  # noqa: BLE001 - any damage (bad UTF-8, JSON, keys, types) is the same finding
        ok = False
    if not ok:
        raise CheckpointFolderError(path, f"{MANIFEST} is damaged (not valid JSON of format {FORMAT!r}, "
                                          "or its digest does not match its file list)")
    if not all(_plain_name(n) for n in files):
        raise CheckpointFolderError(path, f"{MANIFEST} lists a path outside the folder")
    return files


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


# --- .metadata without running code ---------------------------------------------------------------
def _dcp_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    out: dict[tuple[str, str], Any] = {
        (metadata.__name__, n): getattr(metadata, n)
        for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                  "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
    }
    out[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    out[("torch", "Size")] = torch.Size
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # how torch pickles a layout
    for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"):
        out[("pathlib", n)] = getattr(pathlib, n)  # StorageMeta.checkpoint_id
    out[("collections", "OrderedDict")] = collections.OrderedDict
    return out


class _Refused(Exception):
    pass


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Unpickles what DCP's ``.metadata`` holds and nothing else.

    Python's own unpickler, with ``find_class`` limited to DCP's metadata classes, ``torch.Size``,
    torch dtypes / layouts / memory formats and paths, and ``BUILD`` (which sets attributes) limited
    to instances of DCP's classes, so a crafted pickle can neither call anything else nor change
    a class. The pure-Python one because the C unpickler's ``BUILD`` cannot be restricted.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._globals = _dcp_globals()
        # DCP's dataclasses only: not the enum (its members are shared), types, functions or paths
        self._build_types = tuple(v for v in self._globals.values() if dataclasses.is_dataclass(v))

    def find_class(self, module: str, name: str) -> Any:
        obj = self._globals.get((module, name))
        if obj is None and module == "torch" and isinstance(getattr(torch, name, None),
                                                            (torch.dtype, torch.layout, torch.memory_format)):
            obj = getattr(torch, name)
        if obj is None:
            raise _Refused(f"{module}.{name}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")

    def _load_build(self) -> None:
        inst = self.stack[-2]  # (inst, state) on the stack
        if type(inst) not in self._build_types:
            raise _Refused(f"setting the attributes of {type(inst).__module__}.{type(inst).__qualname__}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build


def read_metadata(path: str | os.PathLike[str], data: bytes) -> Any:
    """DCP's ``Metadata`` from the bytes of ``path/.metadata``, unpickled without running code."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise CheckpointFolderError(
            path, f"{METADATA} refers to {exc.args[0]}, which torch.distributed.checkpoint's metadata never "
                  "holds: it was crafted or written by another tool, and was not unpickled",
            "load only checkpoints that your own runs wrote") from None
    except Exception as exc:  # noqa: BLE001 - a torn or damaged pickle fails in many ways
        raise CheckpointFolderError(path, f"{METADATA} cannot be read ({type(exc).__name__}: "
                                          f"{str(exc).strip()[:200] or 'empty or truncated'})") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict) \
            or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointFolderError(path, f"{METADATA} holds a {type(md).__name__}, not DCP's Metadata")
    for info in md.storage_data.values():
        if not _plain_name(getattr(info, "relative_path", None)):
            raise CheckpointFolderError(path, f"{METADATA} points at a file outside the folder "
                                              f"({getattr(info, 'relative_path', None)!r})")
    return md


# --- the check ----------------------------------------------------------------------------------
def verify(path: str | os.PathLike[str], check_hashes: bool = True, allow_unverified: bool = False,
           share: tuple[int, int] = (0, 1), warn: bool = True) -> bytes:
    """Check ``path`` before DCP reads it; returns the checked bytes of its ``.metadata``.

    Raises :class:`CheckpointFolderError` naming the file for a missing manifest (unless
    ``allow_unverified``: then a RuntimeWarning says nothing checks the bytes), a damaged manifest,
    a missing file, a file of the wrong size, a checksum mismatch, or a ``.metadata`` that does not
    unpickle safely. ``check_hashes=False`` checks sizes only (``.metadata`` is always hashed).
    ``share=(i, n)``: hash only every n-th shard from the i-th (ranks split the work). ``warn=False``:
    no warning for an unverified folder (the caller says it).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointFolderError(path, "is not a folder", "pass a step_<N> folder that checkpoint.save wrote, "
                                                              "or checkpoint.latest(root)")
    files = read_manifest(path)
    meta_path = path / METADATA
    if files is None:
        if not meta_path.is_file():
            raise CheckpointFolderError(path, f"incomplete: no {METADATA} and no {MANIFEST} (a save that did not finish)")
        if not allow_unverified:
            raise CheckpointFolderError(
                path, f"has no {MANIFEST}, so nothing can check its files (an overdrive before checksums wrote it, "
                      "or its save stopped before the end)",
                "if you trust it, pass allow_unverified=True to checkpoint.load / checkpoint.latest; "
                "otherwise use checkpoint.latest(root)")
        if warn:
            warnings.warn(f"checkpoint {str(path)!r} has no {MANIFEST}: its files are not checked, so corruption in it "
                          "cannot be detected (its metadata is still read without running code)", RuntimeWarning,
                          stacklevel=4)
        data = meta_path.read_bytes()
        md = read_metadata(path, data)
        for name in sorted({info.relative_path for info in md.storage_data.values()}):
            if not (path / name).is_file():
                raise CheckpointFolderError(path, f"shard {name} is missing")
        return data
    if METADATA not in files:
        raise CheckpointFolderError(path, f"{MANIFEST} does not list {METADATA}")
    for name in sorted(files):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointFolderError(path, f"{'metadata' if name == METADATA else 'shard'} {name} is missing") from None
        if size != files[name]["size"]:
            raise CheckpointFolderError(path, f"{name} is {size} bytes and {MANIFEST} says {files[name]['size']} "
                                              "(truncated, or changed after the save)")
    data = meta_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != files[METADATA]["sha256"]:
        raise CheckpointFolderError(path, f"checksum mismatch in {METADATA} (corrupted or changed after the save)")
    if check_hashes:
        i, n = share
        for name in [m for m in sorted(files) if m != METADATA][i::n]:
            if _sha256(path / name) != files[name]["sha256"]:
                raise CheckpointFolderError(path, f"checksum mismatch in {name} (corrupted or changed after the save)")
    md = read_metadata(path, data)
    for name in sorted({info.relative_path for info in md.storage_data.values()}):
        if name not in files:
            raise CheckpointFolderError(path, f"{METADATA} reads {name}, which {MANIFEST} does not list")
    return data


# --- what DCP loads through ---------------------------------------------------------------------
class SafeReader(FileSystemReader):
    """DCP's file reader, whose metadata is the checked bytes :func:`verify` returned."""

    def __init__(self, path: str | os.PathLike[str], metadata: bytes) -> None:
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if kwargs.get("rank") is not None:  # rank-local metadata: not something checkpoint.save writes
            raise CheckpointFolderError(self.path, f"no per-rank metadata is read (only {METADATA})")
        md = read_metadata(self.path, self._metadata)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class RefusedEntry(Exception):
    """A non-tensor entry that ``torch.load(weights_only=True)`` refuses (crafted, or not overdrive's)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.key, self.reason = key, reason


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - reported with the entry's name, on every rank
            lines = str(exc).strip().splitlines()
            raise RefusedEntry(fqn, f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]) from None
        if self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_element(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    # What DCP's own planner does with a flattened key's object path (nested dicts and lists).
    cur: Any = root
    for key, nxt in zip(path[:-1], path[1:]):
        empty: Any = {} if isinstance(nxt, str) else []
        if isinstance(cur, dict):
            cur = cur.setdefault(key, empty)
        else:
            while len(cur) <= key:
                cur.append(None)
            if cur[key] is None:
                cur[key] = empty
            cur = cur[key]
    last = path[-1]
    if isinstance(last, int):
        while len(cur) <= last:
            cur.append(None)
    cur[last] = value
