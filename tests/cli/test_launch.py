"""``overdrive launch`` with a script that fails on one rank: every rank stopped, exit 1, and the last line is
overdrive's one-line summary, not torchrun's own traceback (``ChildFailedError``), which it was before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[2] / "src"


def test_a_rank_that_raises_ends_in_one_error_line(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise SystemExit('rank 1 gives up')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "overdrive.cli.main", "launch", "--nproc-per-node", "2",
                           "--timeout", "240", str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "fails.py failed" in last and "exit code 1" in last, proc.stderr[-2000:]
    assert "Root Cause" in last and "rank 1 gives up" in proc.stderr
