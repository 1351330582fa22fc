"""`overdrive launch` (and the demo's distributed stage and `doctor --bandwidth`, which go through it) leaves
nothing in the temp folder: torchrun's per-run `torchelastic_*` log folder is made in one of overdrive's and
removed with it."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import build_command, launch


def test_build_command_points_torchrun_at_the_log_dir() -> None:
    cmd = build_command(LaunchConfig(nproc_per_node=1), "train.py", [], log_dir="/x/logs")
    assert cmd[cmd.index("--log-dir") + 1] == "/x/logs" and cmd.index("--log-dir") < cmd.index("train.py")


def test_launch_leaves_no_temp_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # overdrive's own temp folders
    script = tmp_path / "ok.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ['RANK'])\n")
    out = tmp_path / "rank.txt"
    env = dict(os.environ, TMPDIR=str(tmp))  # torchrun's: tempfile.mkdtemp(prefix='torchelastic_') goes here
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    assert launch(LaunchConfig(nproc_per_node=1), str(script), [str(out)], check=False, env=env) == 0
    assert out.read_text() == "0"
    assert sorted(p.name for p in tmp.iterdir()) == []
