"""File list sources: the documented format (spaces, blank lines, comments, CRLF, BOM) and errors naming file:line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from overdrive._utils.errors import UsageError
from overdrive.data.sources import from_list, resolve


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """Empty files are enough: the list parser only checks that each listed path exists."""
    (tmp_path / "sub dir").mkdir()
    for name in ("a.jpg", "sub dir/b c.jpg", "d.jpg"):
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def _pairs(listfile: Path) -> list[tuple[str, int]]:
    return [(s.path, s.label) for s in from_list(listfile)]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("bom", ["", "\ufeff"])
def test_file_list_format(files: Path, newline: str, bom: str) -> None:
    lines = ["# path label   (a comment)", "  a.jpg 0", "", "   ", "sub dir/b c.jpg\t1   ", "\t# indented comment",
             f"{files / 'd.jpg'}   -1", "   "]
    listfile = files / "list.txt"
    listfile.write_bytes((bom + newline.join(lines) + newline).encode("utf-8"))
    want = [(str(files / "a.jpg"), 0), (str(files / "sub dir" / "b c.jpg"), 1), (str(files / "d.jpg"), -1)]
    assert _pairs(listfile) == want
    samples, classes = resolve(listfile)
    assert [(s.path, s.label) for s in samples] == want and classes is None


@pytest.mark.parametrize("bad", ["a.jpg", "a.jpg --3", "a.jpg 1.5", "a.jpg ²", "sub dir/b c.jpg"])
def test_malformed_line_names_file_and_line(files: Path, bad: str) -> None:
    listfile = files / "list.txt"
    listfile.write_text(f"# header\na.jpg 0\n\n{bad}\r\n", newline="")
    with pytest.raises(UsageError, match=rf"list\.txt:4: '{re.escape(bad)}' is not '<path> <integer label>'"):
        from_list(listfile)


def test_missing_image_names_file_and_line(files: Path) -> None:
    listfile = files / "list.txt"
    listfile.write_text("a.jpg 0\ngone.jpg 1\n")
    with pytest.raises(UsageError, match=r"list\.txt:2: image .*gone\.jpg' does not exist"):
        from_list(listfile)


def test_non_text_list_and_bad_pairs_are_usage_errors(files: Path) -> None:
    binary = files / "photo.bin"
    binary.write_bytes(b"\xff\xd8\xff\xe0 not text")
    with pytest.raises(UsageError, match="not UTF-8 text"):
        resolve(binary)
    with pytest.raises(UsageError, match=r"item 1 is .*expected a \(path, integer label\) pair"):
        from_list([(str(files / "a.jpg"), 0), (str(files / "a.jpg"), "cat")])


def test_missing_tar_shard_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"data source '.*gone\.tar' does not exist"):  # was FileNotFoundError
        resolve(tmp_path / "gone.tar")
