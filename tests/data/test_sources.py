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


@pytest.mark.parametrize("label", [1.5, -0.5, float("nan"), True, "1.5"])
def test_pairs_with_a_non_integral_label_are_refused(files: Path, label: object) -> None:
    """int(1.5) is 1: a float label was silently truncated into another class."""
    items = [(str(files / "a.jpg"), 0), (str(files / "d.jpg"), label)]
    with pytest.raises(UsageError, match=rf"item 1 is .*label {re.escape(repr(label))} is not an integer class index"):
        from_list(items)


def test_pairs_accept_integer_like_labels(files: Path) -> None:
    np = pytest.importorskip("numpy")
    import torch

    items = [(str(files / "a.jpg"), np.int64(4)), (str(files / "a.jpg"), 2.0), (str(files / "a.jpg"), torch.tensor(5)),
             (str(files / "a.jpg"), "7")]
    assert [s.label for s in from_list(items)] == [4, 2, 5, 7]


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    import io
    import tarfile

    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _tar_samples(shard: Path) -> list[tuple[int, bytes]]:
    return [(s.label, s.read()) for s in resolve(shard)[0]]


def test_tar_keys_end_at_the_first_dot_of_the_basename(tmp_path: Path) -> None:
    """WebDataset's rule: '000.input.jpg' and '000.cls' are one sample (key '000'); folders are kept in the key,
    dots in folder names do not split it; '._x.jpg' (macOS resource forks) has no key and is skipped."""
    shard = _tar(tmp_path / "s.tar", {
        "000.input.jpg": b"IMG0", "000.cls": b"3",
        "v1.2/001.input.jpg": b"IMG1", "v1.2/001.cls": b"4",
        "other/001.jpg": b"IMG2", "other/001.cls": b"5",  # the same basename in another folder: another sample
        "._000.input.jpg": b"resource fork",
        "002.JPG": b"IMG3", "002.meta.json": b"{}", "002.CLS": b"6",
    })
    assert _tar_samples(shard) == [(3, b"IMG0"), (6, b"IMG3"), (5, b"IMG2"), (4, b"IMG1")]


def test_tar_image_choice_among_several_image_members(tmp_path: Path) -> None:
    """A plain image extension before a compound one, JPEG before PNG, then by name; tar order does not matter."""
    shard = _tar(tmp_path / "s.tar", {
        "a.mask.png": b"MASK", "a.png": b"PNG", "a.jpg": b"JPG", "a.cls": b"0",
        "b.seg.png": b"SEG", "b.input.jpg": b"INPUT", "b.cls": b"1",
        "c.target.jpg": b"TARGET", "c.input.jpg": b"INPUT", "c.cls": b"2",
    })
    assert _tar_samples(shard) == [(0, b"JPG"), (1, b"INPUT"), (2, b"INPUT")]


def test_tar_image_without_label_names_key_and_rule(tmp_path: Path) -> None:
    shard = _tar(tmp_path / "s.tar", {"000.input.jpg": b"IMG", "000.txt": b"a caption"})
    with pytest.raises(UsageError, match=r"image 000\.input\.jpg has no label member 000\.cls.*first dot"):
        resolve(shard)


def test_a_folder_of_shards_with_a_subfolder_is_refused_not_read_as_classes(tmp_path: Path) -> None:
    """A shard folder with any other subfolder (``previews/``) was read as an image folder: one sample of class
    'previews', the shards dropped, silently. Now one error naming both; an uppercase ``.TAR`` is a shard too (it was
    read as a file list)."""
    d = tmp_path / "shards"
    d.mkdir()
    _tar(d / "a.tar", {"000.jpg": b"IMG0", "000.cls": b"1"})
    _tar(d / "B.TAR", {"001.jpg": b"IMG1", "001.cls": b"2"})
    assert sorted(_tar_samples(d)) == [(1, b"IMG0"), (2, b"IMG1")]
    assert _tar_samples(d / "B.TAR") == [(2, b"IMG1")]
    (d / "previews").mkdir()
    (d / "previews" / "p.png").write_bytes(b"x")
    with pytest.raises(UsageError, match=r"holds both \.tar shards .* and subfolders \(previews\)"):
        resolve(d)


def test_webdataset_brace_and_glob_shard_patterns(tmp_path: Path) -> None:
    """``ImageLoader("shard-{0000..0001}.tar")`` (WebDataset's pattern, what DALI and webdataset scripts pass) and
    ``"shard-*.tar"`` said "does not exist". Braces keep their zero padding; a range naming a missing shard is one
    error naming it, not a silently smaller dataset."""
    for i in range(3):
        _tar(tmp_path / f"shard-{i:04d}.tar", {f"{i:03d}.jpg": f"IMG{i}".encode(), f"{i:03d}.cls": str(i).encode()})
    assert _tar_samples(str(tmp_path / "shard-{0000..0001}.tar")) == [(0, b"IMG0"), (1, b"IMG1")]
    assert _tar_samples(str(tmp_path / "shard-{0000,0002}.tar")) == [(0, b"IMG0"), (2, b"IMG2")]
    assert [lab for lab, _ in _tar_samples(str(tmp_path / "shard-*.tar"))] == [0, 1, 2]
    with pytest.raises(UsageError, match=r"1 of its 4 shards do not exist \(the first: '.*shard-0003.tar'\)"):
        resolve(str(tmp_path / "shard-{0000..0003}.tar"))
