"""Where samples come from: image folders, WebDataset-style tar shards, file lists.

Every source becomes one flat list of :class:`Sample` (a byte range in a file plus a label), so
shuffling, sharding and reading are the same for all of them.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from overdrive._utils.errors import UsageError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
_LABEL_EXTS = (".cls", ".label", ".txt")


@dataclass(frozen=True)
class Sample:
    path: str
    label: int
    offset: int = 0
    size: int = -1  # -1: the whole file

    def read(self) -> bytes:
        """The encoded image bytes."""
        with open(self.path, "rb") as f:
            if self.size < 0:
                return f.read()
            f.seek(self.offset)
            return f.read(self.size)


def from_folder(root: str | os.PathLike) -> tuple[list[Sample], list[str]]:
    """``root/<class>/<image>``: one label per class subfolder, classes sorted by name.

    Example:
        >>> # samples, classes = from_folder("train/")
    """
    root = Path(root)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise UsageError(f"{root} has no class subfolders; expected {root}/<class>/<image>.jpg")
    samples = []
    for label, c in enumerate(classes):
        for dirpath, _, files in sorted(os.walk(root / c)):
            for name in sorted(files):
                if name.lower().endswith(IMAGE_EXTS):
                    samples.append(Sample(os.path.join(dirpath, name), label))
    return samples, classes


def from_tars(shards: Sequence[str | os.PathLike]) -> list[Sample]:
    """WebDataset-style shards: members ``<key>.jpg`` (or .png, ...) with ``<key>.cls`` holding the label.

    The label is taken from ``.cls``, else ``.label``, else a ``.txt`` that holds an integer: in WebDataset
    shards ``.txt`` is usually a caption, which is ignored when a ``.cls`` is there or when it is not a number.
    """
    samples = []
    for shard in shards:
        images: dict[str, tuple[int, int]] = {}
        found: dict[str, dict[str, str]] = {}  # key -> {label extension: text}
        with tarfile.open(shard, "r:") as tf:  # uncompressed only: members must be seekable byte ranges
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = os.path.splitext(m.name)
                ext = ext.lower()
                if ext in IMAGE_EXTS:
                    images[key] = (m.offset_data, m.size)
                elif ext in _LABEL_EXTS:
                    f = tf.extractfile(m)
                    assert f is not None
                    found.setdefault(key, {})[ext] = f.read().decode(errors="replace").strip()
        for key in sorted(images):
            texts = found.get(key, {})
            label = None
            for ext in _LABEL_EXTS:  # in priority order
                if ext not in texts:
                    continue
                try:
                    label = int(texts[ext])
                    break
                except ValueError:
                    if ext != ".txt":
                        raise UsageError(f"{shard}: label member {key}{ext} holds {texts[ext][:60]!r}, expected an "
                                         "integer class index") from None
            if label is None:
                raise UsageError(f"{shard}: image {key} has no label member {key}.cls (or an integer {key}.txt)")
            off, size = images[key]
            samples.append(Sample(str(shard), label, off, size))
    return samples


def from_list(items: Sequence[tuple[str, int]] | str | os.PathLike) -> list[Sample]:
    """A list of ``(path, label)`` pairs, or a text file with one ``path label`` per line."""
    if isinstance(items, (str, os.PathLike)):
        base = Path(items).parent
        pairs = []
        for n, line in enumerate(Path(items).read_text().splitlines(), 1):
            if not line.strip():
                continue
            parts = line.rsplit(maxsplit=1)
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise UsageError(f"{items}:{n}: {line!r} is not '<path> <integer label>'")
            p = Path(parts[0])
            pairs.append((str(p if p.is_absolute() else base / p), int(parts[1])))
        items = pairs
    out = []
    for p, label in items:
        if not os.path.isfile(p):
            raise UsageError(f"file list entry {p!r} does not exist")
        out.append(Sample(str(p), int(label)))
    return out


def resolve(source: str | os.PathLike | Sequence) -> tuple[list[Sample], list[str] | None]:
    """Any supported source -> (samples, class names or None)."""
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            tars = sorted(p.glob("*.tar"))
            if tars and not any(d.is_dir() and not d.name.startswith(".") for d in p.iterdir()):  # hidden: .ipynb_checkpoints
                samples, classes = from_tars(tars), None
            else:
                samples, classes = from_folder(p)
        elif p.suffix == ".tar":
            samples, classes = from_tars([p]), None
        elif p.is_file():
            samples, classes = from_list(p), None
        else:
            raise UsageError(f"data source {str(source)!r} does not exist; pass an image folder, a .tar shard "
                             "(or a folder of them), a file list, or a list of (path, label)")
    elif isinstance(source, Sequence) and source and all(str(s).endswith(".tar") for s in source):
        samples, classes = from_tars(list(source)), None
    elif isinstance(source, Sequence):
        samples, classes = from_list(list(source)), None
    else:
        raise UsageError(f"data source of type {type(source).__name__} is not supported")
    if not samples:
        raise UsageError(f"data source {source!r} holds no images (extensions {IMAGE_EXTS})")
    return samples, classes
