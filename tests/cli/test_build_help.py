"""build --help says what --backend tensorrt is: no engine, an ONNX file and the trtexec command."""

from __future__ import annotations

import pytest

from overdrive.cli.main import main


def test_build_help_says_tensorrt_builds_no_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["build", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tensorrt builds none" in out and "trtexec command" in out
