"""Reading a text dataset from disk for :func:`overdrive.data.tokenize`: plain text (one text per line, or per file),
JSON Lines (one field of each row) and CSV/TSV (one column), gzip-compressed or not, in UTF-8 or (with a BOM) UTF-16 /
UTF-32: a file, a folder of them, a glob pattern, or a list of these."""

from __future__ import annotations

import codecs
import csv
import glob
import gzip
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from overdrive._utils.errors import UsageError

TEXT_SUFFIXES = (".txt", ".text", ".md")  # plain text; with ".gz" after them too
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TABLE_SUFFIXES = (".csv", ".tsv")


def _kind(p: Path) -> str | None:
    """'text', 'jsonl', 'csv', 'tsv' or None (not a text file), from the name (a trailing .gz ignored)."""
    name = p.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TABLE_SUFFIXES):
        return name[-3:]
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


# byte order marks and the encodings they announce; UTF-32 LE's starts with UTF-16 LE's, so it is looked for first
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"), (codecs.BOM_UTF8, "utf-8"),
         (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def _read(p: Path, errors: str) -> str:
    if p.name.lower().endswith(".gz"):
        try:
            with gzip.open(p, "rb") as f:
                raw = f.read()
        except (OSError, EOFError) as exc:  # not gzip, or cut short
            raise UsageError(f"{p}: not a whole gzip file ({exc}); recompress it, or drop .gz from a plain file's "
                             "name") from None
    else:
        try:
            raw = p.read_bytes()
        except OSError as exc:  # unreadable: permissions, a link that loops or points nowhere
            raise UsageError(f"{p}: cannot be read ({exc.strerror or exc}); fix its permissions or link, or leave it "
                             "out of the paths given") from None
    # a file that starts with a BOM is in the encoding the BOM names: Windows tools (Notepad's "Unicode", PowerShell
    # 5's > and Out-File) write UTF-16 with one, which read as UTF-8 was refused, or with errors='replace' read as
    # texts of U+FFFD and NUL characters. The BOM is dropped here, not by "utf-8-sig": that codec counts an error's
    # position after the BOM, which named a byte 3 too early and, for a bad byte within 3 of a line start, the line
    # before it
    encoding, skip = "utf-8", 0
    for bom, enc in _BOMS:
        if raw.startswith(bom):
            encoding, skip = enc, len(bom)
            break
    try:
        return raw[skip:].decode(encoding, errors=errors)
    except UnicodeDecodeError as exc:
        at = exc.start + skip
        line = raw[skip:at].decode(encoding, errors="replace").count("\n") + 1
        name = encoding.upper().removesuffix("-LE").removesuffix("-BE")
        raise UsageError(f"{p}: byte {at} (line {line}) is not {name} ({exc.reason}); convert the file to UTF-8, "
                         "or pass errors='replace' to read such bytes as U+FFFD") from None


def _lines(content: str) -> list[str]:
    """Lines as a file's universal newlines give them (``\n``, ``\r\n``, ``\r``): ``str.splitlines`` also splits on
    U+2028, form feeds and others, which split texts (and JSON strings) that hold them."""
    lines = content.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


_ALL_SUFFIXES = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES)


def _field(row: dict[str, Any], field: str) -> Any:
    """``row[field]``; a dotted ``field`` ("meta.body") that is no key of the row walks nested objects, and an integer
    part indexes a list ("messages.0.content", "messages.-1.content"). KeyError, with the keys of the object (or
    the length of the list) where the walk stopped, when it is missing."""
    if field in row:
        return row[field]
    node: Any = row
    for part in field.split("."):
        if isinstance(node, list):
            try:
                node = node[int(part)]
            except (ValueError, IndexError):
                raise KeyError(f"a list of {len(node)} item(s), indexed 0..{len(node) - 1}") from None
            continue
        if not isinstance(node, dict) or part not in node:
            keys = sorted(node) if isinstance(node, dict) else type(node).__name__
            raise KeyError(keys)
        node = node[part]
    return node


def _jsonl_texts(p: Path, content: str, field: str) -> list[str]:
    texts = []
    for n, line in enumerate(_lines(content), 1):
        if not line.strip():
            continue
        try:  # a BOM inside the file: files that each began with one, joined (cat a.jsonl b.jsonl > all.jsonl)
            row = json.loads(line.lstrip("\ufeff"))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{p}: line {n} is not JSON ({exc.msg}); JSON Lines files hold one JSON object "
                             "per line") from None
        if not isinstance(row, dict):
            raise UsageError(f"{p}: line {n} is a JSON {type(row).__name__}, expected an object with a field "
                             f"{field!r}") from None
        try:
            value = _field(row, field)
        except KeyError as exc:
            raise UsageError(f"{p}: line {n} has no field {field!r} (it has {exc.args[0]}); pass field= one of "
                             "those (a nested one as 'outer.inner', a list's item as 'outer.0')") from None
        if not isinstance(value, str):
            raise UsageError(f"{p}: line {n}: field {field!r} is a {type(value).__name__}, expected a string")
        texts.append(value)
    return texts


def _table_texts(p: Path, content: str, kind: str, field: str) -> list[str]:
    """Column ``field`` (named in the header row) of a CSV or TSV file; quoted cells may hold newlines and
    delimiters, as Python's ``csv`` and pandas read them."""
    reader = csv.reader(io.StringIO(content, newline=""), delimiter="," if kind == "csv" else "\t")
    # csv refuses a cell over 128 KiB (a long document); the limit is process-wide, so it is raised for this
    # file only and put back
    old_limit = csv.field_size_limit(2**31 - 1)
    try:
        header = next(reader, None)
        if header is None:
            return []
        if field not in header:
            raise UsageError(f"{p}: no column {field!r} in the header row (columns: {header}); pass field= one of "
                             "those (the first line of a CSV/TSV file names the columns)")
        col = header.index(field)
        texts, start = [], reader.line_num + 1
        for row in reader:
            if row and len(row) <= col:
                raise UsageError(f"{p}: line {start} has {len(row)} cells, no {field!r} (column {col + 1} of "
                                 f"{len(header)}); fix the row, or quote a cell that holds the delimiter")
            texts.append(row[col] if row else "")
            start = reader.line_num + 1
    except csv.Error as exc:
        raise UsageError(f"{p}: line {reader.line_num} is not {kind.upper()} ({exc}); check its quoting") from None
    finally:
        csv.field_size_limit(old_limit)
    return texts


def _folder_files(root: Path) -> list[Path]:
    """The text files under ``root``, sorted, each real file once. Linked folders are followed (a corpus assembled
    from symlinks to shards elsewhere: ``Path.rglob`` before Python 3.13 skipped them, and their texts silently),
    each real folder once, so a link to a folder above does not loop. Hidden files and folders
    (.ipynb_checkpoints, editor backups) are left out, as the image folders do: their copies were read as texts of
    their own, a corpus with duplicates."""
    files, seen = [], set()
    for top, dirs, names in os.walk(root, followlinks=True):
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:  # reached again through a link: already walked
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [p for n in names if not n.startswith(".")
                  and _kind(p := Path(top) / n) is not None and p.is_file()]
    return _once(sorted(files))


def _once(files: Iterable[Path]) -> list[Path]:
    """``files`` in order, each real file once: the first of the paths (through links) that reach it."""
    seen: set[str] = set()
    out = []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def _source_files(source: str | os.PathLike[str]) -> list[Path]:
    """The text files of one source: a file, a folder (its text files, sorted), or a glob pattern that names no
    existing path (``"shards/*.jsonl.gz"``, ``"corpus/**/*.txt"``: the text files and folders it matches, sorted)."""
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(f"path={source!r} ({type(source).__name__}): expected a file, a folder or a glob pattern "
                         "(a str or Path), or a list of them")
    root = Path(source).expanduser()
    if not root.exists() and glob.has_magic(str(root)):
        matches = sorted(Path(m) for m in glob.glob(str(root), recursive=True))
        # a folder matched stands for its text files; each file once ("corpus/**" matches folders and their files,
        # and glob follows a link to a folder above round its loop)
        files = _once(f for m in matches for f in (
            _folder_files(m) if m.is_dir() else [m] if m.is_file() and _kind(m) is not None else []))
        if not files:
            found = f"matches {len(matches)} path(s) but no text file" if matches else "matches nothing"
            raise UsageError(f"pattern {str(root)!r} {found}; expected names ending {_ALL_SUFFIXES} (optionally .gz)")
        return files
    if not root.exists():
        raise UsageError(f"{str(root)!r} does not exist; give a text, JSON Lines or CSV/TSV file, a folder of them, "
                         "or a glob pattern ('data/*.jsonl')")
    if root.is_dir():
        files = _folder_files(root)
        if not files:
            raise UsageError(f"{str(root)!r} holds no text files (names ending {_ALL_SUFFIXES}, optionally .gz)")
        return files
    if _kind(root) is None:
        raise UsageError(f"{str(root)!r}: not a text file by its name; expected a name ending {_ALL_SUFFIXES} "
                         "(optionally .gz)")
    return [root]


def read_texts(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], field: str = "text",
               per: str = "line", errors: str = "strict", skip_empty: bool = True) -> list[str]:
    """The texts of a dataset on disk, ready for :func:`overdrive.data.tokenize`.

    ``path`` is a file, a folder (every ``.txt``/``.text``/``.md``/``.jsonl``/``.ndjson``/``.csv``/``.tsv`` file
    under it, sorted by path, each possibly ``.gz``-compressed), a glob pattern (``"shards/*.jsonl.gz"``,
    ``"corpus/**/*.txt"``: the text files it matches, sorted), or a list of these (read in the order given, as a
    shell's ``data/*.jsonl`` hands them over). Plain text gives one text per line
    (``per="line"``, line ends ``\\n``, ``\\r\\n`` or ``\\r`` removed) or one per file (``per="file"``: documents);
    JSON Lines gives each row's ``field`` (``"outer.inner"`` for a nested one, ``"messages.0.content"`` for an item
    of a list; a row without it is an error naming the file, the line and the keys it has); CSV/TSV gives the
    column the header row names ``field`` (quoted cells may hold newlines). Files are read as UTF-8, or as UTF-16 /
    UTF-32 where a byte order mark says so (the BOM dropped); ``errors="replace"`` reads undecodable bytes as
    U+FFFD instead of refusing the file. ``skip_empty`` leaves out empty and whitespace-only texts.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); d = Path(tmp.name)
        >>> _ = (d / "a.txt").write_text("first line\\r\\n\\nsecond\\n")
        >>> _ = (d / "b.jsonl").write_text('{"text": "a row", "id": 1}\\n')
        >>> _ = (d / "c.csv").write_text('id,text\\n1,"two\\nlines"\\n')
        >>> read_texts(d)
        ['first line', 'second', 'a row', 'two\\nlines']
        >>> read_texts(d / "*.jsonl")
        ['a row']
        >>> tmp.cleanup()
    """
    if per not in ("line", "file"):
        raise UsageError(f"per={per!r}: expected 'line' (one text per line) or 'file' (one text per file)")
    if errors not in ("strict", "replace", "ignore"):
        raise UsageError(f"errors={errors!r}: expected 'strict', 'replace' or 'ignore'")
    if not isinstance(field, str) or not field:
        raise UsageError(f"field={field!r}: expected the name of a JSON Lines field or CSV/TSV column, e.g. 'text'")
    sources = [path] if isinstance(path, (str, os.PathLike)) else path
    if not isinstance(sources, Sequence) or not sources:
        raise UsageError(f"path={path!r}: expected a file, a folder or a glob pattern, or a non-empty list of them")
    files = [f for source in sources for f in _source_files(source)]
    texts: list[str] = []
    for p in files:
        content = _read(p, errors)
        kind = _kind(p)
        if kind == "jsonl":
            texts.extend(_jsonl_texts(p, content, field))
        elif kind in ("csv", "tsv"):
            texts.extend(_table_texts(p, content, kind, field))
        elif per == "file":
            texts.append(content)
        else:
            texts.extend(_lines(content))
    return [t for t in texts if t.strip()] if skip_empty else texts
