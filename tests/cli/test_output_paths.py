"""Every verb's output path is checked before any work: a missing parent folder is one line and exit 2, and
no folder is created (``quantize --export /nonexistent/x.onnx`` used to make ``/nonexistent/`` and exit 0)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from overdrive.cli.main import main


def _cases(missing: Path, tmp: Path) -> list[tuple[list[str], str]]:
    bad = str(missing / "sub" / "out.x")
    return [
        (["build", "--onnx", str(tmp / "m.onnx"), "--save-engine", bad], "--save-engine"),
        (["build", "--onnx", str(tmp / "m.onnx"), "--save-engine", str(tmp / "m.engine"), "--timing-cache", bad], "--timing-cache"),
        (["build", "--onnx", str(tmp / "m.onnx"), "--save-engine", str(tmp / "m.engine"), "--json", bad], "--json"),
        (["quantize", "--export", bad], "--export"),
        (["quantize", "--save", bad], "--save"),
        (["quantize", "--json", bad], "--json"),
        (["sparsify", "--model", "digits", "--out", bad], "--out"),
        (["sparsify", "--model", "digits", "--out", str(tmp / "s.pt"), "--json", bad], "--json"),
        (["demo", "--quick", "--json", bad], "--json"),
        (["demo", "--quick", "--report", bad], "--report"),
        (["exec", "--load-engine", str(tmp / "m.engine"), "--export-times", bad], "--export-times"),
        (["exec", "--load-engine", str(tmp / "m.engine"), "--export-profile", bad], "--export-profile"),
        (["exec", "--load-engine", str(tmp / "m.engine"), "--json", bad], "--json"),
        (["env", "--json", bad], "--json"),
        (["doctor", "--json", bad], "--json"),
        (["compare", "a.engine", "b.onnx", "--json", bad], "--json"),
        (["data", "make-dataset", bad, "-n", "1"], "ROOT"),
        (["data", "bench", str(tmp), "--json", bad], "--json"),
    ]


@pytest.mark.parametrize("i", range(len(_cases(Path("m"), Path("t")))))
def test_output_in_a_missing_folder_is_refused_before_work(tmp_path: Path, i: int) -> None:
    missing = tmp_path / "missing"
    args, flag = _cases(missing, tmp_path)[i]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], lines
    assert "parent folder does not exist" in lines[0] and "create it" in lines[0]
    assert not missing.exists()  # nothing made above the path named


def test_output_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["quantize", "--export", str(tmp_path)])
    assert code == 2 and "is a directory" in err.getvalue()
    (tmp_path / "f").write_text("")
    with contextlib.redirect_stderr(err):
        code = main(["demo", "--quick", "--report", str(tmp_path / "f")])
    assert code == 2 and "not a folder" in err.getvalue()
