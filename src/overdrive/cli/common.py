"""Helpers shared by the verbs: console output and JSON writing."""

from __future__ import annotations

import click

import json
import math
import sys
from pathlib import Path
from typing import Any


def json_option(what: str) -> Any:
    """The one ``--json [FILE]`` of every verb: bare ``--json`` (or ``--json -``) prints ``what`` as JSON on stdout
    instead of the tables; ``--json FILE`` writes it to FILE as well as printing the tables.

    Example:
        >>> @click.command()
        ... @json_option("the report")
        ... def cmd(json_path): click.echo(repr(json_path))
        >>> from click.testing import CliRunner
        >>> CliRunner().invoke(cmd, ["--json"]).output.strip(), CliRunner().invoke(cmd, ["--json", "r.json"]).output.strip()
        ("'-'", "'r.json'")
    """
    return click.option("--json", "json_path", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
                        help=f"Write {what} as JSON: to FILE, or to stdout instead of the tables with a bare --json.")


def console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


VERBOSE = False  # set by overdrive.cli.main from --verbose: commands that catch errors print tracebacks too


def write_json(data: Any, target: str | None) -> None:
    """Write ``data`` as JSON to ``target`` ('-' or None: stdout)."""
    text = json.dumps(_clean(data), indent=2, default=str)
    if target in (None, "-"):
        sys.stdout.write(text + "\n")
    else:
        from overdrive._utils.files import atomic_write

        atomic_write(target, text + "\n")


def check_json_target(target: str | None) -> None:
    """Refuse a ``--json FILE`` whose folder does not exist before the work, not after it."""
    if target not in (None, "-") and not Path(target).parent.is_dir():
        from overdrive._utils.errors import UsageError

        raise UsageError(f"--json {target}: folder {str(Path(target).parent)!r} does not exist; create it or give "
                         "another path ('-' for stdout)")
