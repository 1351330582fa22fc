"""Tables printed to a pipe keep their columns: rich fell back to 80 columns when stdout was not a TTY and
cut the demo's wide tables mid-column."""

from __future__ import annotations

import io
import sys

import pytest

from overdrive._utils.table import Table
from overdrive.cli.common import PIPED_WIDTH, console


def test_piped_console_is_wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    cols = [f"column number {i}" for i in range(8)]  # ~130 characters of header
    t = Table("wide", cols, [[f"value {i}" for i in range(8)]])
    con = console()
    assert con.width == PIPED_WIDTH
    con.print(t.render())
    lines = buf.getvalue().splitlines()
    assert any(all(c in line for c in cols) for line in lines)  # every header on one line, none cut


def test_columns_env_still_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert console().width == 100
