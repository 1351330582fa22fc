"""The git commit a result was measured at: for benchmark results and the demo's report.

Example:
    >>> commit, dirty = git_state(".")  # (None, None) outside a git checkout
"""

from __future__ import annotations

import os
import subprocess


def git_state(cwd: str | os.PathLike[str]) -> tuple[str | None, bool | None]:
    """(short commit, dirty) of the checkout at ``cwd``; (None, None) when git is missing, fails, or ``cwd``
    is not a git checkout (a copied tree, a container). ``dirty`` counts tracked files only."""
    commit = _git(["rev-parse", "--short", "HEAD"], cwd)
    if not commit:
        return None, None
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return commit.strip(), (bool(status.strip()) if status is not None else None)


def _git(args: list[str], cwd: str | os.PathLike[str]) -> str | None:
    # A result must still be written where git is absent or broken.
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return r.stdout if r.returncode == 0 else None
