"""CI runs the README's test command: the line in .ci/run is the Quickstart's second command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = [ln.strip() for ln in readme.splitlines() if ln.startswith("bash scripts/bootstrap.sh")]
    assert len(commands) == 2, commands  # Quickstart: demo, then tests
    demo, tests = commands
    assert demo.endswith("overdrive demo")
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert tests in ci
