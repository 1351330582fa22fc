"""The CLI's front door: a group named without its verb shows its help (not one mashed error line), and Ctrl-C
is reported as an interruption with exit 130."""

from __future__ import annotations

import click
import pytest

from overdrive.cli.main import main


@pytest.mark.parametrize("args", [[], ["data"]])
def test_a_group_without_a_verb_prints_its_help(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error:" not in err
    assert err.startswith("Usage: overdrive") and "\nCommands:\n" in err


def test_ctrl_c_is_interrupted_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """click turns KeyboardInterrupt into Abort: the CLI said 'aborted' and exited 1, not as Ctrl-C does."""
    import overdrive._utils.device as device

    def interrupted() -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(device, "environment_report", interrupted)
    assert main(["env"]) == 130
    assert capsys.readouterr().err.strip() == "error: interrupted"


def test_an_abort_that_is_no_ctrl_c_stays_exit_1(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import overdrive._utils.device as device

    def abort() -> dict:
        raise click.Abort()

    monkeypatch.setattr(device, "environment_report", abort)
    assert main(["env"]) == 1
    assert capsys.readouterr().err.strip() == "error: aborted"
