"""Reading a text dataset from disk for :func:`overdrive.data.tokenize`: plain text (one text per line, or per file),
JSON Lines (one field of each row) and CSV/TSV (one column), gzip-compressed or not, a file or a folder of them."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from pathlib import Path
from typing import Any

from overdrive._utils.errors import UsageError

TEXT_SUFFIXES = (".txt", ".text", ".md")  # plain text; with ".gz" after them too
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TABLE_SUFFIXES = (".csv", ".tsv")
_BOM = "\ufeff".encode()


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


def _read(p: Path, errors: str) -> str:
    if p.name.lower().endswith(".gz"):
        try:
            with gzip.open(p, "rb") as f:
                raw = f.read()
        except (OSError, EOFError) as exc:  # not gzip, or cut short
            raise UsageError(f"{p}: not a whole gzip file ({exc}); recompress it, or drop .gz from a plain file's "
                             "name") from None
    else:
        raw = p.read_bytes()
    # the BOM dropped here, not by "utf-8-sig": that codec counts an error's position after the BOM, which named a
    # byte 3 too early and, for a bad byte within 3 of a line start, the line before it
    skip = len(_BOM) if raw.startswith(_BOM) else 0
    try:
        return raw[skip:].decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        at = exc.start + skip
        line = raw[:at].count(b"\n") + 1
        raise UsageError(f"{p}: byte {at} (line {line}) is not UTF-8 ({exc.reason}); convert the file to UTF-8, "
                         "or pass errors='replace' to read such bytes as U+FFFD") from None


def _lines(content: str) -> list[str]:
    """Lines as a file's universal newlines give them (``\n``, ``\r\n``, ``\r``): ``str.splitlines`` also splits on
    U+2028, form feeds and others, which split texts (and JSON strings) that hold them."""
    lines = content.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


_ALL_SUFFIXES = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES)


def _field(row: dict[str, Any], field: str) -> Any:
    """``row[field]``; a dotted ``field`` ("meta.body") that is no key of the row walks nested objects. KeyError,
    with the keys of the object where the walk stopped, when it is missing."""
    if field in row:
        return row[field]
    node: Any = row
    for part in field.split("."):
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
        try:
            row = json.loads(line)
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
                             "those (a nested one as 'outer.inner')") from None
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


def read_texts(path: str | os.PathLike[str], field: str = "text", per: str = "line", errors: str = "strict",
               skip_empty: bool = True) -> list[str]:
    """The texts of a dataset on disk, ready for :func:`overdrive.data.tokenize`.

    ``path`` is a file or a folder (every ``.txt``/``.text``/``.md``/``.jsonl``/``.ndjson``/``.csv``/``.tsv`` file
    under it, sorted by path, each possibly ``.gz``-compressed). Plain text gives one text per line
    (``per="line"``, line ends ``\\n``, ``\\r\\n`` or ``\\r`` removed) or one per file (``per="file"``: documents);
    JSON Lines gives each row's ``field`` (``"outer.inner"`` for a nested one; a row without it is an error naming
    the file, the line and the keys it has); CSV/TSV gives the column the header row names ``field`` (quoted cells
    may hold newlines). Files are read as UTF-8 (a BOM dropped); ``errors="replace"`` reads undecodable bytes as
    U+FFFD instead of refusing the file. ``skip_empty`` leaves out empty and whitespace-only texts.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); d = Path(tmp.name)
        >>> _ = (d / "a.txt").write_text("first line\\r\\n\\nsecond\\n")
        >>> _ = (d / "b.jsonl").write_text('{"text": "a row", "id": 1}\\n')
        >>> _ = (d / "c.csv").write_text('id,text\\n1,"two\\nlines"\\n')
        >>> read_texts(d)
        ['first line', 'second', 'a row', 'two\\nlines']
        >>> tmp.cleanup()
    """
    if per not in ("line", "file"):
        raise UsageError(f"per={per!r}: expected 'line' (one text per line) or 'file' (one text per file)")
    if errors not in ("strict", "replace", "ignore"):
        raise UsageError(f"errors={errors!r}: expected 'strict', 'replace' or 'ignore'")
    if not isinstance(field, str) or not field:
        raise UsageError(f"field={field!r}: expected the name of a JSON Lines field or CSV/TSV column, e.g. 'text'")
    root = Path(path).expanduser()
    if not root.exists():
        raise UsageError(f"{str(root)!r} does not exist; give a text, JSON Lines or CSV/TSV file, or a folder of them")
    if root.is_dir():
        # hidden files and folders (.ipynb_checkpoints, editor backups) left out, as the image folders do: their copies
        # were read as texts of their own, a corpus with duplicates
        files = sorted(p for p in root.rglob("*") if p.is_file() and _kind(p) is not None
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if not files:
            raise UsageError(f"{str(root)!r} holds no text files (names ending {_ALL_SUFFIXES}, optionally .gz)")
    else:
        if _kind(root) is None:
            raise UsageError(f"{str(root)!r}: not a text file by its name; expected a name ending {_ALL_SUFFIXES} "
                             "(optionally .gz)")
        files = [root]
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
