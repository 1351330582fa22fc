"""``--backend tensorrt`` writes the ONNX model for trtexec beside the engine path (``<saveEngine stem>.onnx``) and
prints the trtexec line. It used to write over whatever that path held: the user's own ``model.onnx`` when the
engine was ``model.engine``, the very file given with ``--onnx``."""

from __future__ import annotations

from pathlib import Path

import pytest

from overdrive.cli.main import main


def test_the_users_onnx_file_is_never_replaced(digits_onnx: bytes, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "model.onnx"
    src.write_bytes(digits_onnx)
    mine = tmp_path / "keep.onnx"
    mine.write_bytes(digits_onnx)
    other = tmp_path / "keep.engine"  # its ONNX path is keep.onnx, which holds the user's model as given
    assert main(["build", "--onnx", str(src), "--save-engine", str(tmp_path / "model.engine"), "--backend", "tensorrt",
                 "--device", "cpu", "--shapes", "x:2x1x8x8"]) == 1
    err = capsys.readouterr().err
    assert "trtexec --onnx=" in err
    assert src.read_bytes() == digits_onnx  # untouched
    named = err.split("trtexec --onnx=")[1].split()[0]
    assert Path(named).exists() and (Path(named) == src or Path(named).name == "model.export1.onnx")
    (tmp_path / "notes.onnx").write_text("a file of the user's")
    assert main(["build", "--onnx", str(mine), "--save-engine", str(tmp_path / "notes.engine"), "--backend", "tensorrt",
                 "--device", "cpu", "--shapes", "x:2x1x8x8"]) == 1
    err = capsys.readouterr().err
    assert (tmp_path / "notes.onnx").read_text() == "a file of the user's"
    assert "notes.export1.onnx" in err and (tmp_path / "notes.export1.onnx").stat().st_size > 100
    assert not other.exists()
