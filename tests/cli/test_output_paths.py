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


def _same_path_cases(tmp: Path) -> list[tuple[list[str], str, str]]:
    """(args, the file that must survive, the flag named in the error). Inputs exist, with content to compare."""
    m, e, py, ck, cal, x = (str(tmp / n) for n in ("m.onnx", "m.engine", "net.py", "ck.pt", "calib.pt", "x.bin"))
    return [
        (["build", "--onnx", m, "--save-engine", m], m, "--save-engine"),
        (["build", "--onnx", m, "--saveEngine", str(tmp / "." / "m.onnx")], m, "--save-engine"),
        (["build", "--onnx", m, "--save-engine", e, "--json", m], m, "--json"),
        (["build", "--onnx", m, "--save-engine", e, "--timing-cache", e], e, "--timing-cache"),
        (["build", "--model", f"{py}:make", "--save-engine", py], py, "--save-engine"),
        (["build", "--onnx", m, "--save-engine", cal, "--int8", "--calib", cal], cal, "--save-engine"),
        (["exec", "--load-engine", e, "--export-times", e], e, "--export-times"),
        (["exec", "--load-engine", e, "--json", e], e, "--json"),
        (["exec", "--load-engine", e, "--load-inputs", f"input:{x}", "--export-output", x], x, "--export-output"),
        (["compare", e, m, "--json", m], m, "--json"),
        (["quantize", "--model", f"{py}:make", "--export", py], py, "--export"),
        (["quantize", "--model", f"{py}:make", "--checkpoint", ck, "--save", ck], ck, "--save"),
        (["quantize", "--calib-data", cal, "--export", cal], cal, "--export"),
        (["sparsify", "--model", f"{py}:make", "--checkpoint", ck, "--out", ck], ck, "--out"),
    ]


@pytest.mark.parametrize("i", range(len(_same_path_cases(Path("t")))))
def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path: Path, i: int) -> None:
    """``build --onnx m.onnx --saveEngine m.onnx`` replaced the model with the engine and exited 0; the same for the
    other verbs' outputs over their inputs (a model's .py source, a checkpoint, calibration data, an engine) and an
    engine written over the timing cache. Now: one line naming both flags, exit 2, the file byte for byte as it was."""
    for n in ("m.onnx", "m.engine", "net.py", "ck.pt", "calib.pt", "x.bin"):
        (tmp_path / n).write_bytes(f"content of {n}".encode())
    args, keep, flag = _same_path_cases(tmp_path)[i]
    before = Path(keep).read_bytes()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}"), lines
    assert "give" in lines[0] and ("input" in lines[0] or "output" in lines[0])
    assert Path(keep).read_bytes() == before


def test_a_link_to_an_input_is_the_input(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"model")
    (tmp_path / "link.onnx").symlink_to(tmp_path / "m.onnx")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["build", "--onnx", str(tmp_path / "m.onnx"), "--save-engine", str(tmp_path / "link.onnx")])
    assert code == 2 and "is the --onnx input" in err.getvalue()
    assert (tmp_path / "m.onnx").read_bytes() == b"model"


def test_an_output_over_a_dotted_model_specs_source_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model victim_model:make --save-engine victim_model.py`` replaced the model's code with an engine (only the
    ``victim_model.py:make`` form was checked). Now: one line, exit 2, the source byte for byte as it was."""
    import sys

    src = "import torch\ndef make():\n    return torch.nn.Linear(4, 2)\n"
    (tmp_path / "victim_model_a.py").write_text(src)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for args in (["build", "--model", "victim_model_a:make", "--shapes", "x:2x4", "--save-engine", "victim_model_a.py"],
                 ["build", "--model", "victim_model_a:make", "--shapes", "x:2x4", "--save-engine", "v.engine",
                  "--json", "victim_model_a.py"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(args)
        assert code == 2 and "victim_model_a.py is the --model input" in err.getvalue(), err.getvalue()
        assert (tmp_path / "victim_model_a.py").read_text() == src


def test_an_error_prints_a_path_with_colons_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rich read ':x:' in 'run:x:1.engine' as an emoji code: the error named 'run❌1.engine' and told the user to
    build that."""
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["exec", "--load-engine", "run:x:1.engine"])
    assert code == 2 and "run:x:1.engine" in err.getvalue() and "\u274c" not in err.getvalue(), err.getvalue()
