"""Writes that cannot tear: a unique temporary file in the destination's folder, flushed and fsynced, then
renamed over the destination (``os.replace`` is atomic on POSIX and Windows). A reader sees the old file or
the new one, never a mix; two writers to one path leave one whole file; a crash mid-write leaves the old
file and no temporary behind. A device or pipe (``--json /dev/null``, ``/dev/stdout``) is written through instead.

Example:
    >>> import tempfile, pathlib
    >>> d = tempfile.mkdtemp()
    >>> p = atomic_write(pathlib.Path(d) / "a.bin", b"hello")
    >>> p.read_bytes(), sorted(x.name for x in pathlib.Path(d).iterdir())
    (b'hello', ['a.bin'])
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any

_UMASK: int | None = None


def require_file(path: str | os.PathLike[str], what: str, hint: str = "") -> Path:
    """``path`` as a Path if it is a file; else a :class:`UsageError` that says whether it is missing or a folder.

    Example:
        >>> require_file("/", "ONNX file")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: ONNX file '/' is a folder, not a file; give the file's path
    """
    from overdrive._utils.errors import UsageError

    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a folder, not a file; give the file's path")
    raise UsageError(f"{what} {str(path)!r} does not exist" + (f"; {hint}" if hint else ""))


def _default_mode() -> int:
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0)
        os.umask(_UMASK)
    return 0o666 & ~_UMASK


def _special(path: Path) -> bool:
    """Whether ``path`` exists and is no regular file or folder (a device such as ``/dev/null``, ``/dev/stdout``, a
    named pipe): renaming a temporary file over it would replace the device itself (as root: ``/dev/null`` became
    a plain file for every process on the machine), so such a path is written through."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def atomic_write(path: str | os.PathLike[str], data: bytes | str, durable: bool = True) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns the path. An existing file keeps its
    permission bits; a new one gets the usual ``0o666 & ~umask``. ``durable=False`` skips the fsyncs (a reader or
    a killed process still never sees part of a file, but a power cut may lose it): for many small files that can
    be made again, where a sync each costs more than writing them."""
    from overdrive._utils.errors import UsageError

    path = Path(path)
    blob = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if _special(path):  # /dev/null, /dev/stdout, a named pipe: written through, never renamed over
        with open(path, "wb") as f:
            f.write(blob)
        return path
    if path.is_dir():
        raise UsageError(f"cannot write {str(path)!r}: it is a folder; give a file path such as "
                         f"{str(path / 'out')!r}")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {str(path)!r}: folder {str(path.parent)!r} does not exist; create it first")
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = _default_mode()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:  # a read-only or pseudo file system (/proc), where os.access said yes to root
        raise UsageError(f"cannot write {str(path)!r}: folder {str(path.parent)!r} takes no new files "
                         f"({exc.strerror or exc}); give a path in a folder you can write to") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not durable:
        return path
    try:  # the rename itself survives a power cut once the folder is synced (POSIX; best effort elsewhere)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` for a writer that takes a file name (an ONNX exporter); when the block
    ends without an error the file is fsynced and renamed over ``path``, else removed. ``path`` holds the old file
    or the whole new one, never a part; the permission bits follow :func:`atomic_write`'s.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> with atomic_path(d / "a.txt") as tmp:
        ...     _ = tmp.write_text("new")
        >>> (d / "a.txt").read_text(), sorted(x.name for x in d.iterdir())
        ('new', ['a.txt'])
    """
    path = Path(path)
    if _special(path):  # /dev/null, a named pipe: the writer writes to it itself
        yield path
        return
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = _default_mode()
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)`` through :func:`atomic_write`."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write(path, buf.getvalue())


@contextlib.contextmanager
def quiet_fds() -> Iterator[None]:
    """Send what C++ code writes to file descriptors 1 and 2 to /dev/null for the block (the TorchScript ONNX
    exporter prints the whole IR graph, hundreds of lines, to stdout when it fails; overdrive tries it first and
    falls back). Python-level ``sys.stdout`` / ``sys.stderr`` writes are silenced too. A no-op where the
    descriptors cannot be duplicated.

    Example:
        >>> with quiet_fds():
        ...     print("not shown")
    """
    import sys

    saved: list[tuple[int, int]] = []
    devnull = -1
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            saved.append((fd, os.dup(fd)))
            os.dup2(devnull, fd)
    except (OSError, ValueError, AttributeError):  # no real descriptors here: run the block as it is
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        saved = []
    old = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = io.StringIO()
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        if devnull >= 0:
            os.close(devnull)
