"""Ctrl-C (SIGINT to the terminal's process group) or SIGTERM (``kill``, a scheduler's cancel, to the launcher alone)
during `overdrive launch`: one line, exit 130, and no rank left running; a rank's own error still shows, named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import overdrive

SRC = str(Path(overdrive.__file__).resolve().parents[1])

WAITING_RANK = """\
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
folder = sys.argv[1]
open(os.path.join(folder, f"ready{dist.get_rank()}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(folder, f"ready{dist.get_rank()}.tmp"), os.path.join(folder, f"ready{dist.get_rank()}"))
while not os.path.exists(os.path.join(folder, "go")):  # until the launch is stopped
    time.sleep(0.02)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=SRC, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie that only waits to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            pytest.fail(f"the launch exited ({proc.returncode}) before its ranks were ready:\n{proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the ranks did not start within {timeout_s:g} s")
        time.sleep(0.05)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups")
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_launch_says_one_line_exits_130_and_leaves_no_rank(tmp_path: Path, how: str) -> None:
    script = tmp_path / "wait.py"
    script.write_text(WAITING_RANK)
    proc = subprocess.Popen([sys.executable, "-m", "overdrive", "launch", "--nproc-per-node", "2", str(script),
                             str(tmp_path)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own group: a terminal's Ctrl-C goes to the whole group
    ready = [tmp_path / "ready0", tmp_path / "ready1"]
    _wait_for(ready, proc)
    pids = [int(p.read_text()) for p in ready]
    try:
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)  # the launcher alone: it must stop torchrun and the ranks itself
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert "error: interrupted" in err
        for noise in ("Traceback", "KeyboardInterrupt", "SignalException", "death signal", "closing signal"):
            assert noise not in err, err
        assert [pid for pid in pids if _running(pid)] == []
    finally:
        (tmp_path / "go").touch()  # a rank left behind by a failure above ends on its own


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and process groups")
def test_a_rank_that_fails_on_its_own_still_shows_its_error_with_its_rank(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n    raise ValueError('lr=-1 must be positive')\ndist.barrier()\n")
    res = subprocess.run([sys.executable, "-m", "overdrive", "launch", "--nproc-per-node", "2", str(script)],
                         env=_env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 1
    assert "[rank1]: ValueError: lr=-1 must be positive" in res.stderr
