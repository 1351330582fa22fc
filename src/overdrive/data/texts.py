"""Reading a text dataset from disk for :func:`overdrive.data.tokenize`: plain text (one text per line, or per file)
and JSON Lines (one field of each row), gzip-compressed or not, a file or a folder of them."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from overdrive._utils.errors import UsageError

TEXT_SUFFIXES = (".txt", ".text", ".md")  # plain text; with ".gz" after them too
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def _kind(p: Path) -> str | None:
    """'text', 'jsonl' or None (not a text file), from the name (a trailing .gz ignored)."""
    name = p.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
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
    try:
        return raw.decode("utf-8-sig", errors=errors)
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UsageError(f"{p}: byte {exc.start} (line {line}) is not UTF-8 ({exc.reason}); convert the file to UTF-8, "
                         "or pass errors='replace' to read such bytes as U+FFFD") from None


def _lines(content: str) -> list[str]:
    """Lines as a file's universal newlines give them (``\n``, ``\r\n``, ``\r``): ``str.splitlines`` also splits on
    U+2028, form feeds and others, which split texts (and JSON strings) that hold them."""
    lines = content.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def read_texts(path: str | os.PathLike[str], field: str = "text", per: str = "line", errors: str = "strict",
               skip_empty: bool = True) -> list[str]:
    """The texts of a dataset on disk, ready for :func:`overdrive.data.tokenize`.

    ``path`` is a file or a folder (every ``.txt``/``.text``/``.md``/``.jsonl``/``.ndjson`` file under it, sorted by
    path, each possibly ``.gz``-compressed). Plain text gives one text per line (``per="line"``, line ends ``\\n``,
    ``\\r\\n`` or ``\\r`` removed) or one per file (``per="file"``: documents); JSON Lines gives each row's ``field``
    (a row without it is an error naming the file, the line and the keys it has). Files are read as UTF-8 (a BOM
    dropped); ``errors="replace"`` reads undecodable bytes as U+FFFD instead of refusing the file. ``skip_empty``
    leaves out empty and whitespace-only texts.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); d = Path(tmp.name)
        >>> _ = (d / "a.txt").write_text("first line\\r\\n\\nsecond\\n")
        >>> _ = (d / "b.jsonl").write_text('{"text": "a row", "id": 1}\\n')
        >>> read_texts(d)
        ['first line', 'second', 'a row']
        >>> tmp.cleanup()
    """
    if per not in ("line", "file"):
        raise UsageError(f"per={per!r}: expected 'line' (one text per line) or 'file' (one text per file)")
    if errors not in ("strict", "replace", "ignore"):
        raise UsageError(f"errors={errors!r}: expected 'strict', 'replace' or 'ignore'")
    root = Path(path).expanduser()
    if not root.exists():
        raise UsageError(f"{str(root)!r} does not exist; give a text or JSON Lines file, or a folder of them")
    if root.is_dir():
        # hidden files and folders (.ipynb_checkpoints, editor backups) left out, as the image folders do: their copies
        # were read as texts of their own, a corpus with duplicates
        files = sorted(p for p in root.rglob("*") if p.is_file() and _kind(p) is not None
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if not files:
            raise UsageError(f"{str(root)!r} holds no text files (names ending {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}"
                             ", optionally .gz)")
    else:
        if _kind(root) is None:
            raise UsageError(f"{str(root)!r}: not a text file by its name; expected a name ending "
                             f"{', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} (optionally .gz)")
        files = [root]
    texts: list[str] = []
    for p in files:
        content = _read(p, errors)
        if _kind(p) == "jsonl":
            for n, line in enumerate(_lines(content), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{p}: line {n} is not JSON ({exc.msg}); JSON Lines files hold one JSON object "
                                     "per line") from None
                if not isinstance(row, dict) or field not in row:
                    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise UsageError(f"{p}: line {n} has no field {field!r} (it has {keys}); pass field= one of those")
                value = row[field]
                if not isinstance(value, str):
                    raise UsageError(f"{p}: line {n}: field {field!r} is a {type(value).__name__}, expected a string")
                texts.append(value)
        elif per == "file":
            texts.append(content)
        else:
            texts.extend(_lines(content))
    return [t for t in texts if t.strip()] if skip_empty else texts
