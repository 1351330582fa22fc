"""scripts/gpu_demo.sh: with ``tests`` it runs the demo's GPU tests only, and copies no demo report into $OUT (the
report in the checkout is an older run's; it was copied as if this run had made it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_demo.sh"


def test_tests_only_copies_no_old_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), TESTS_LIMIT_S="200")
    res = subprocess.run(["bash", str(SCRIPT), "tests"], capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert list(out.iterdir()) == []
