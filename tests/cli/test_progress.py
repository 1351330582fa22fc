"""Long silent steps show a spinner with the elapsed time on stderr (ONNX export and the rest of build and
quantize, doctor --bandwidth, the demo's distributed stage): only when stderr is a terminal and not with
--no-progress or a bare --json; piped, nothing is written."""

from __future__ import annotations

import io
import sys

import pytest

from overdrive._utils import progress
from overdrive.cli.main import cli


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_shown_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress.shown(True)
    with progress.status("exporting"):
        pass
    assert sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert progress.shown(True) and not progress.shown(False)


def test_spinner_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setenv("TERM", "xterm")
    with progress.status("exporting ONNX"):
        pass
    assert "exporting ONNX" in tty.getvalue()


@pytest.mark.parametrize("verb", ["build", "quantize", "doctor", "demo"])
def test_verbs_with_long_steps_take_no_progress(verb: str) -> None:
    import click

    cmd = cli.get_command(click.Context(cli), verb)
    assert any("--no-progress" in p.opts for p in cmd.params)  # type: ignore[union-attr]
