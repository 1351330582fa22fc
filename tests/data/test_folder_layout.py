"""Image folders as users have them: links to folders (followed, as torchvision's ImageFolder follows them),
link loops (each folder read once), hidden folders and files (skipped: a hidden class took label 0)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from overdrive.data.sources import from_folder


def _touch(p: Path) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"")  # the folder scan looks at names only


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "train"
    for rel in ("cat/a.jpg", "cat/sub/B.JPG", "dog/c.png", "dog/.ipynb_checkpoints/c-checkpoint.png", "dog/._c.png",
                ".ipynb_checkpoints/x.jpg"):
        _touch(root / rel)
    _touch(tmp_path / "elsewhere/more/d.jpeg")
    os.symlink(tmp_path / "elsewhere/more", root / "dog" / "linked")  # a folder linked into a class
    os.symlink(root / "cat", root / "cat" / "sub" / "up")  # a loop back to the class folder
    return root


def test_links_followed_loops_once_hidden_skipped(tree: Path) -> None:
    samples, classes = from_folder(tree)
    got = [(os.path.relpath(s.path, tree), s.label) for s in samples]
    # before: the linked folder was not read, and '.ipynb_checkpoints' was class 0 (cat 1, dog 2), the hidden
    # checkpoint copy and the macOS fork were samples of dog
    assert classes == ["cat", "dog"]
    assert got == [("cat/a.jpg", 0), ("cat/sub/B.JPG", 0), ("dog/c.png", 1), ("dog/linked/d.jpeg", 1)]


def test_an_empty_class_folder_is_said_and_keeps_its_label(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before: a class folder with no image kept its label slot without a word (torchvision's ImageFolder raises)."""
    pytest.importorskip("PIL")
    from PIL import Image

    from overdrive.data.sources import from_folder

    for c in ("a", "b_empty", "c"):
        (tmp_path / c).mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "a" / "x.png")
    Image.new("RGB", (4, 4)).save(tmp_path / "c" / "y.png")
    with pytest.warns(RuntimeWarning, match=r"class folder\(s\) \['b_empty'\] hold no image; their labels stay reserved"):
        samples, classes = from_folder(tmp_path)
    assert classes == ["a", "b_empty", "c"] and [s.label for s in samples] == [0, 2]
