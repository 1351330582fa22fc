"""Where samples come from: image folders, WebDataset-style tar shards, file lists.

Every source becomes one flat list of :class:`Sample` (a byte range in a file plus a label), so
shuffling, sharding and reading are the same for all of them.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import re
import stat
import tarfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from overdrive._utils.errors import UsageError

# torchvision's ImageFolder extensions (.ppm/.pgm included: GTSRB ships as .ppm) and the rest of the Netpbm family
# WebDataset decodes; the order is the tie-break between several images of one tar sample (JPEG first)
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm")
_LABEL_EXTS = (".cls", ".label", ".txt")


@dataclass(frozen=True)
class Sample:
    path: str
    label: int
    offset: int = 0
    size: int = -1  # -1: the whole file

    def read(self) -> bytes:
        """The encoded image bytes. Only regular files are opened (a FIFO named ``x.jpg`` would block for
        ever, ``/dev/zero`` would be read without end) and at most :func:`max_file_bytes` are read; either
        is an OSError naming the file, which the loader counts as an unreadable file and skips."""
        st = os.stat(self.path)  # follows links: a link to a device is refused too
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{self.path} is not a regular file (a FIFO, device or socket); only files are read")
        limit = max_file_bytes()
        want = st.st_size if self.size < 0 else self.size
        if want > limit:
            raise OSError(f"{self.path} holds {want:,} bytes, over the {limit:,}-byte limit for one image "
                          "(OVERDRIVE_MAX_FILE_BYTES raises it)")
        with open(self.path, "rb") as f:
            if self.size < 0:
                data = f.read(limit + 1)  # the file may have grown since the stat
                if len(data) > limit:
                    raise OSError(f"{self.path} holds over {limit:,} bytes, the limit for one image "
                                  "(OVERDRIVE_MAX_FILE_BYTES raises it)")
                return data
            f.seek(self.offset)
            return f.read(self.size)


def max_file_bytes() -> int:
    """The most bytes one image file may hold: ``OVERDRIVE_MAX_FILE_BYTES`` or 256 MiB.

    Example:
        >>> max_file_bytes() >= 1 << 20
        True
    """
    raw = os.environ.get("OVERDRIVE_MAX_FILE_BYTES")
    if raw is None:
        return 256 << 20
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"OVERDRIVE_MAX_FILE_BYTES={raw!r} is not a whole number of bytes") from None
    if value < 1:
        raise UsageError(f"OVERDRIVE_MAX_FILE_BYTES={value} must be >= 1")
    return value


def from_folder(root: str | os.PathLike) -> tuple[list[Sample], list[str]]:
    """``root/<class>/<image>``: one label per class subfolder, classes sorted by name.

    Images may sit in nested folders of a class. Links to folders are followed, as torchvision's ImageFolder
    follows them (a folder reached twice, through a link loop, is read once). Hidden folders and files (a name
    starting with ``.``: ``.ipynb_checkpoints``, macOS ``._x.jpg`` forks) are skipped: a hidden class folder
    would take label 0 and shift every other class's label.

    Example:
        >>> # samples, classes = from_folder("train/")
    """
    root = Path(root)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise UsageError(f"{root} has no class subfolders; expected {root}/<class>/<image>.jpg")
    samples = []
    empty: list[str] = []
    for label, c in enumerate(classes):
        seen: set[str] = set()  # real paths of the folders walked: a link back up must not loop
        found = []
        for dirpath, dirs, files in os.walk(root / c, followlinks=True):  # top-down: pruning `dirs` takes effect
            real = os.path.realpath(dirpath)
            if real in seen:
                dirs[:] = []
                continue
            seen.add(real)
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [(dirpath, name) for name in files if name.lower().endswith(IMAGE_EXTS) and not name.startswith(".")]
        samples += [Sample(os.path.join(d, name), label) for d, name in sorted(found)]
        if not found:
            empty.append(c)
    if empty:
        # torchvision's ImageFolder refuses this; here the labels stay as the folder names order them (a split whose
        # class folder is empty keeps the other split's label numbers), said once
        warnings.warn(f"{root}: class folder(s) {empty[:5]}{' ...' if len(empty) > 5 else ''} hold no image; their "
                      f"labels stay reserved ({len(classes)} classes in all), so check the folder if that is not meant",
                      RuntimeWarning, stacklevel=3)
    return samples, classes


# WebDataset's rule (webdataset.tariterators.base_plus_ext): the key is the member path up to the first dot of
# its basename (folders kept), the extension everything after that dot. A basename starting with a dot
# (macOS '._x.jpg' resource forks, '.DS_Store') has no key and is skipped, as WebDataset skips it.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./][^./]*)\.([^/]*)$")


def split_key(name: str) -> tuple[str, str] | None:
    """WebDataset's (key, extension) of a tar member name, the extension lower-cased; None if it has none.

    Example:
        >>> split_key("train/000.input.jpg"), split_key("a.b/000.cls"), split_key("._000.jpg")
        (('train/000', 'input.jpg'), ('a.b/000', 'cls'), None)
    """
    m = _KEY_EXT.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


def _image_rank(ext: str) -> tuple[int, int, str] | None:
    """Sort key of a member extension as a sample's image, None if it is not one. An extension is an image when
    its last part is an image type (``jpg``, ``input.jpg``). A plain image extension comes before a compound one
    (``jpg`` before ``seg.png``), then the order of IMAGE_EXTS (JPEG first: the GPU path decodes it), then the name."""
    last = ext.rsplit(".", 1)[-1]
    types = [e[1:] for e in IMAGE_EXTS]
    if last not in types:
        return None
    return ("." in ext, types.index(last), ext)


def _scan_tar(shard: str | os.PathLike, images: dict[str, tuple[tuple[int, int, str], int, int]],
              found: dict[str, dict[str, str]]) -> None:
    """Index one shard's members into ``images`` and ``found``; a shard cut short is an error naming it (tarfile
    stops quietly at a cut that falls between members, and lists the members before it)."""
    size_on_disk = os.path.getsize(shard)
    with tarfile.open(shard, "r:") as tf:  # uncompressed only: members must be seekable byte ranges
        for m in tf:
            if m.offset_data + m.size > size_on_disk:
                raise UsageError(f"{shard}: member {m.name} runs past the end of the {size_on_disk:,}-byte file "
                                 "(truncated); re-create or re-download the shard")
            if not m.isfile() or (parts := split_key(m.name)) is None:
                continue
            key, ext = parts
            rank = _image_rank(ext)
            if rank is not None:
                if key not in images or rank < images[key][0]:
                    images[key] = (rank, m.offset_data, m.size)
            elif "." + ext in _LABEL_EXTS:
                f = tf.extractfile(m)
                assert f is not None
                found.setdefault(key, {})["." + ext] = f.read().decode(errors="replace").strip()
        end = tf.offset  # where the end-of-archive marker (two zero blocks) must stand
    with open(shard, "rb") as fh:
        fh.seek(end)
        marker = fh.read(1024)
    if len(marker) < 1024 or any(marker):
        raise UsageError(f"{shard}: no end-of-archive marker after its last member at byte {end:,} (the file is "
                         f"{size_on_disk:,} bytes: truncated?); re-create or re-download the shard")


_COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"), (b"\xfd7zXZ\x00", "xz", "unxz"),
               (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"))
_COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".tzst")


def compressed_shard_error(path: str | os.PathLike) -> UsageError | None:
    """The error for a compressed tar shard (by its first bytes), None if ``path`` is not compressed.

    Example:
        >>> compressed_shard_error(__file__) is None
        True
    """
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return None
    for magic, kind, tool in _COMPRESSED:
        if head.startswith(magic):
            return UsageError(f"{path} is a {kind}-compressed tar; shards must be uncompressed .tar files (members are "
                              f"read as byte ranges): decompress it with `{tool} -k {path}` and pass the .tar")
    return None


def from_tars(shards: Sequence[str | os.PathLike]) -> list[Sample]:
    """WebDataset-style shards: members ``<key>.jpg`` (or .png, ...) with ``<key>.cls`` holding the label.

    Members are grouped into samples by WebDataset's rule: the key is the member path up to the first dot of
    its basename (``train/000.input.jpg`` -> key ``train/000``, extension ``input.jpg``). A member is an image
    when its extension ends in an image type (``jpg``, ``input.jpg``); when a sample has several, the image is a
    plain one before a compound one (``jpg`` before ``mask.png``), then by type in the order of IMAGE_EXTS
    (jpg, jpeg, png, bmp, webp, tif, tiff, ppm, pgm, pbm, pnm), then by name. The label is taken from ``.cls``,
    else ``.label``, else a ``.txt`` that holds an integer: in WebDataset shards ``.txt`` is usually a caption,
    which is ignored when a ``.cls`` is there or when it is not a number.
    """
    samples = []
    for shard in shards:
        images: dict[str, tuple[tuple[int, int, str], int, int]] = {}  # key -> (rank, offset, size) of its image
        found: dict[str, dict[str, str]] = {}  # key -> {label extension: text}
        if (err := compressed_shard_error(shard)) is not None:
            raise err
        try:
            _scan_tar(shard, images, found)
        except (tarfile.ReadError, EOFError) as exc:
            raise UsageError(f"{shard}: not a readable tar shard, truncated or corrupt ({exc}); re-create or "
                             "re-download it") from exc
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
                raise UsageError(f"{shard}: image {key}.{images[key][0][2]} has no label member {key}.cls (or an "
                                 f"integer {key}.txt); WebDataset keys end at the first dot of the file name")
            _, off, size = images[key]
            samples.append(Sample(str(shard), label, off, size))
    return samples


_LABEL = re.compile(r"-?[0-9]+")  # ASCII digits only: str.isdigit() also takes '²', which int() rejects


def _read_list_file(path: str | os.PathLike) -> list[tuple[str, int]]:
    """``(path, label)`` pairs of a file list (format in the data README); malformed lines name file:line."""
    try:
        # utf-8-sig drops a BOM (Windows editors write one); text mode reads CRLF and CR line ends as LF
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"file list {str(path)!r} is not UTF-8 text (byte {exc.start}); a file list holds one "
                         "'<path> <integer label>' per line (pass an image folder or a .tar shard directly)") from None
    base = Path(path).parent
    pairs = []
    for n, line in enumerate(text.split("\n"), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):  # blank lines and comments
            continue
        parts = entry.rsplit(maxsplit=1)  # the label is the last field; the path may hold spaces
        if len(parts) != 2 or not _LABEL.fullmatch(parts[1]):
            raise UsageError(f"{path}:{n}: {line!r} is not '<path> <integer label>' (e.g. 'cats/001.jpg 3'); fix "
                             "or remove that line, or start it with '#' to make it a comment")
        p = Path(parts[0])
        full = str(p if p.is_absolute() else base / p)
        if not os.path.isfile(full):
            raise UsageError(f"{path}:{n}: image {full!r} does not exist (relative paths are relative to the "
                             "list's folder); fix the path or remove the line")
        pairs.append((full, int(parts[1])))
    return pairs


def _integer_label(label: object, i: int, item: object) -> int:
    """``label`` as an int: an int (Python, NumPy or a 0-d integer tensor), an integral float (2.0) or a string of
    digits. A non-integral float (1.5) is refused, not truncated by ``int()`` into another class."""
    if not isinstance(label, bool):  # True/False are ints to Python, but not class indices
        try:
            return operator.index(label)  # int, np.int64, integer 0-d tensors
        except TypeError:
            pass
        if isinstance(label, str) and _LABEL.fullmatch(label.strip()):
            return int(label)
        if isinstance(label, numbers.Real) and math.isfinite(label) and float(label).is_integer():
            return int(label)
    raise UsageError(f"file list item {i} is {item!r}: label {label!r} is not an integer class index, expected a "
                     "(path, integer label) pair such as ('cats/001.jpg', 3); map the label to its integer class")


def from_list(items: Sequence[tuple[str, int]] | str | os.PathLike) -> list[Sample]:
    """A list of ``(path, label)`` pairs, or a text file with one ``path label`` per line.

    File format (see the data README): UTF-8, LF or CRLF line ends; each line is a path, whitespace,
    and an integer label (the last field, so the path may contain spaces); surrounding spaces, blank
    lines and lines starting with ``#`` are ignored; relative paths are relative to the list's folder.

    Example:
        >>> # samples = from_list("train.txt")   # lines like 'cats/001.jpg 3'
    """
    if isinstance(items, (str, os.PathLike)):
        items = _read_list_file(items)
    out = []
    for i, item in enumerate(items):
        try:
            p, label = item
        except (TypeError, ValueError):
            raise UsageError(f"file list item {i} is {item!r}, expected a (path, integer label) pair") from None
        label = _integer_label(label, i, item)
        if not os.path.isfile(p):
            raise UsageError(f"file list entry {p!r} does not exist")
        out.append(Sample(str(p), label))
    return out


def expand_shards(pattern: str) -> list[str]:
    """WebDataset's shard patterns: braces (``{0000..0099}``, zero padding kept; ``{a,b}``) expanded, then glob
    wildcards (``*``, ``?``, ``[...]``) matched; the existing ``.tar`` files, in order.

    Example:
        >>> expand_shards("/nonexistent/shard-{00..01}.tar")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: data source '/nonexistent/shard-{00..01}.tar' names 2 shard(s), of which none exists (the first: '/nonexistent/shard-00.tar')
    """
    import glob

    names = [pattern]
    brace = re.compile(r"\{([^{}]*)\}")
    while any(brace.search(n) for n in names):
        out = []
        for n in names:
            m = brace.search(n)
            if m is None:
                out.append(n)
                continue
            body = m.group(1)
            rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
            if rng:
                lo, hi = rng.group(1), rng.group(2)
                width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
                parts = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
            else:
                parts = body.split(",")
            out += [n[:m.start()] + part + n[m.end():] for part in parts]
        names = out
    found = [f for n in names for f in (sorted(glob.glob(n)) if any(c in n for c in "*?[") else [n])
             if Path(f).is_file()]
    if not found:
        raise UsageError(f"data source {pattern!r} names {len(names)} shard(s), of which none exists (the first: "
                         f"{names[0]!r})")
    missing = [n for n in names if not any(c in n for c in "*?[") and not Path(n).is_file()]
    if missing:
        raise UsageError(f"data source {pattern!r}: {len(missing)} of its {len(names)} shards do not exist (the "
                         f"first: {missing[0]!r}); check the range")
    return found


def resolve(source: str | os.PathLike | Sequence) -> tuple[list[Sample], list[str] | None]:
    """Any supported source -> (samples, class names or None)."""
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            tars = sorted(q for q in p.iterdir() if q.suffix.lower() == ".tar" and q.is_file())
            dirs = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith("."))  # hidden: .ipynb_checkpoints
            subdirs = bool(dirs)
            packed = [q for q in sorted(p.iterdir()) if q.name.lower().endswith(_COMPRESSED_SUFFIXES)]
            if tars and subdirs:  # which one is the dataset? Reading the folders as classes dropped the shards
                raise UsageError(f"{str(p)!r} holds both .tar shards ({tars[0].name}, ...) and subfolders "
                                 f"({', '.join(dirs[:3])}): pass the shards (a list of .tar paths, or a folder of "
                                 "shards only) or an image folder whose subfolders are the classes")
            if tars:
                samples, classes = from_tars(tars), None
            elif packed and not subdirs:  # compressed shards only: say so, not "no class subfolders"
                raise compressed_shard_error(packed[0]) or UsageError(
                    f"{packed[0]} is a compressed tar; shards must be uncompressed .tar files")
            else:
                samples, classes = from_folder(p)
        elif p.is_file() and (p.suffix.lower() == ".tar" or compressed_shard_error(p) is not None):
            samples, classes = from_tars([p]), None  # a missing one gets the "does not exist" message below
        elif p.is_file():
            samples, classes = from_list(p), None
        elif any(c in str(source) for c in "{*?["):  # WebDataset's "shard-{0000..0099}.tar", or a glob
            shards = expand_shards(str(source))
            samples, classes = from_tars(shards), None
        else:
            raise UsageError(f"data source {str(source)!r} does not exist; pass an image folder, a .tar shard "
                             "(or a folder of them), a file list, or a list of (path, label)")
    elif isinstance(source, Sequence) and source and all(str(s).lower().endswith(".tar") for s in source):
        samples, classes = from_tars(list(source)), None
    elif isinstance(source, Sequence):
        samples, classes = from_list(list(source)), None
    else:
        raise UsageError(f"data source of type {type(source).__name__} is not supported; pass a folder, a .tar shard, "
                         "a file list, or a list of (path, label) (a generator: list(...) it first)")
    if not samples:
        raise UsageError(f"data source {source!r} holds no images (extensions {IMAGE_EXTS})")
    return samples, classes
