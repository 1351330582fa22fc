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


def test_a_module_no_rank_could_import_is_refused_before_the_ranks(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import pytest

    from overdrive._utils.errors import UsageError
    from overdrive.distributed.config import LaunchConfig
    from overdrive.distributed.launch import check_module, launch

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="no module or package 'mypkgx' in this folder"):
        launch(LaunchConfig(nproc_per_node=2), "mypkgx.train", module=True, check=False,
               env={"PYTHONPATH": ""})
    for bad in ("train.py", "my-pkg.train", ""):
        with pytest.raises(UsageError, match="is not a module name"):
            check_module(bad, {})
    (tmp_path / "mypkgx").mkdir()
    (tmp_path / "mypkgx" / "__init__.py").write_text("")
    check_module("mypkgx.train", {})  # the ranks run from this folder: found (its submodule is the rank's to import)
    elsewhere = tmp_path / "lib"
    (elsewhere / "otherpkg").mkdir(parents=True)
    check_module("json", {})
    with pytest.raises(UsageError):
        check_module("otherpkg.train", {})
    check_module("otherpkg.train", {"PYTHONPATH": str(elsewhere)})  # a namespace package on PYTHONPATH
