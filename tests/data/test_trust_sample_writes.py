"""``make_sample_dataset`` writes each JPEG whole: a write that stops part way (a full disk, a kill) leaves no
truncated image under an image's name for a later benchmark to trip on, and no temporary file behind."""

from __future__ import annotations

import errno
import io
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("PIL")
pytest.importorskip("skimage")


class _DiskFullAfterHalf:
    """A binary file that takes half of a JPEG, then fails as a full disk does."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: bytes) -> int:
        if bytes(data[:2]) == b"\xff\xd8":  # a JPEG's first bytes
            self._f.write(bytes(data[: len(data) // 2]))
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _DiskFullAfterHalf:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def test_interrupted_image_write_leaves_no_torn_jpeg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.data import make_sample_dataset

    real_open = io.open

    def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        return _DiskFullAfterHalf(f) if "w" in mode and "b" in mode else f

    monkeypatch.setattr(io, "open", opening)
    root = tmp_path / "imgs"
    with pytest.raises(OSError, match="No space left"):
        make_sample_dataset(root, n=2, classes=1, size=(32, 24))
    monkeypatch.undo()
    left = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert left == []  # neither a torn img_000000.jpg nor a temporary file


def test_sample_images_are_whole_jpegs(tmp_path: Path) -> None:
    from PIL import Image

    from overdrive.data import make_sample_dataset

    root = make_sample_dataset(tmp_path / "imgs", n=3, classes=2, size=(32, 24))
    files = sorted(root.rglob("*"))
    assert [p.name for p in files if p.is_file()] == ["img_000000.jpg", "img_000002.jpg", "img_000001.jpg"]
    for p in files:
        if p.is_file():
            with Image.open(p) as im:
                im.load()  # a truncated JPEG raises here
