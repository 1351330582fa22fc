"""benchmarks/_common.py: the one results writer (one JSON layout, meta with commit/version/date/command,
markdown header, atomic writes, no failure when git is missing)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import overdrive
from overdrive._utils.table import Table

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_common.py"


@pytest.fixture(scope="module")
def common():
    # benchmarks/ is not a package: load the file under a name no script uses
    spec = importlib.util.spec_from_file_location("overdrive_benchmarks_common", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def repo(tmp_path: Path, common, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A throwaway git checkout with one commit, set as the checkout the writer asks git about."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    root.mkdir()
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
                               *args], cwd=root, env=env, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (root / "tracked.txt").write_text("a\n")
    git("add", "tracked.txt")
    git("commit", "-q", "-m", "one")
    monkeypatch.setattr(common, "REPO", root)
    return root, git("rev-parse", "--short", "HEAD")


@pytest.fixture(autouse=True)
def _no_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)  # the lent GPU machine sets it; the writer copies into it


def _write_rows(common, folder: Path, name: str = "bench") -> tuple[dict, str]:
    facts = {**common.device_facts(torch.device("cpu")), "wall_s": 1.25}
    j, m = common.write_results(name, facts, [{"config": "eager", "ms": 1.5}, {"config": "engine", "ms": 0.5}],
                                ["config", "ms"], ["a note"], out_dir=folder)
    return json.loads(j.read_text()), m.read_text()


def test_meta_records_commit_version_date_command(common, repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _, commit = repo
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench.py", "--quick", "two words"])
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    data, md = _write_rows(common, tmp_path / "out")
    meta = data["meta"]
    assert meta["commit"] == commit and meta["dirty"] is False
    assert meta["overdrive"] == overdrive.__version__
    assert meta["torch"] == torch.__version__ and meta["cuda"] == torch.version.cuda
    assert meta["argv"] == ["benchmarks/bench.py", "--quick", "two words"]
    assert meta["command"] == "python benchmarks/bench.py --quick 'two words'"
    date = dt.datetime.fromisoformat(meta["date"])
    assert date.tzinfo is not None and before <= date <= dt.datetime.now(dt.timezone.utc)
    assert meta["wall_s"] == 1.25  # the script's own facts follow the standard ones
    assert list(meta)[: len(common.META_KEYS)] == list(common.META_KEYS)
    # the markdown starts with the same meta
    header = md.split("| config |")[0]
    assert md.startswith("# bench\n")
    for s in (f"commit: {commit}", f"overdrive {overdrive.__version__}", f"date: {meta['date']}",
              f"command: `{meta['command']}`", f"torch {torch.__version__}", "wall_s: 1.250"):
        assert s in header, s
    # the rows table the scripts rely on, then the notes
    assert "| config | ms |\n|---|---|\n| eager | 1.500 |\n| engine | 0.500 |\n\n- a note\n" in md
    assert data["results"] == {"rows": [{"config": "eager", "ms": 1.5}, {"config": "engine", "ms": 0.5}],
                               "notes": ["a note"]}


def test_dirty_counts_tracked_changes_only(common, repo):
    root, commit = repo
    (root / "untracked.txt").write_text("new\n")
    assert common.git_state() == (commit, False)
    (root / "tracked.txt").write_text("changed\n")
    assert common.git_state() == (commit, True)
    meta = common.run_meta()
    assert (meta["commit"], meta["dirty"]) == (commit, True)


def test_same_layout_for_rows_and_tables(common, repo, tmp_path: Path):
    rows_json, _ = _write_rows(common, tmp_path, "rows_kind")
    t = Table("engine vs eager", ["batch", "config", "ms"], [[1, "eager", 2.0], [1, "engine", 1.0]], notes=["t note"])
    facts = {**common.device_facts(torch.device("cpu")), "wall_s": 3.0}
    j, m = common.write_results("tables_kind", facts, tables=[t], extra={"records": [{"k": 1}]}, title="Engines",
                                out_dir=tmp_path)
    tables_json = json.loads(j.read_text())
    assert set(rows_json) == set(tables_json) == {"meta", "results"}
    assert list(rows_json["meta"]) == list(tables_json["meta"])
    assert tables_json["results"]["tables"] == [t.to_dict()]
    assert tables_json["results"]["records"] == [{"k": 1}] and tables_json["results"]["notes"] == []
    md = m.read_text()
    assert md.startswith("# Engines\n") and t.to_markdown().rstrip("\n") in md


def test_missing_facts_are_filled_in(common, repo, tmp_path: Path):
    # an old-style caller passing only some facts still gets every standard key
    j, _ = common.write_results("partial", {"device": "some GPU"}, [], ["a"], [], out_dir=tmp_path)
    meta = json.loads(j.read_text())["meta"]
    assert set(common.META_KEYS) <= set(meta) and meta["device"] == "some GPU" and meta["commit"] == repo[1]


def test_positional_extra_lands_in_results(common, tmp_path: Path):
    # the call data_profile.py and engine_profile.py make: extra as the sixth positional argument
    j, _ = common.write_results("p", {}, [{"a": 1}], ["a"], ["n"], {"profiles": {"k": 2}}, out_dir=tmp_path)
    assert json.loads(j.read_text())["results"] == {"rows": [{"a": 1}], "profiles": {"k": 2}, "notes": ["n"]}


def test_reserved_extra_key_is_refused(common, tmp_path: Path):
    with pytest.raises(ValueError, match="reserved key"):
        common.write_results("x", {}, [], ["a"], [], {"rows": []}, out_dir=tmp_path)


def test_git_not_on_path_gives_null_commit(common, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert common.git_state() == (None, None)
    data, md = _write_rows(common, tmp_path / "out")
    assert data["meta"]["commit"] is None and data["meta"]["dirty"] is None
    assert "commit: unknown" in md


@pytest.mark.parametrize("failure", [OSError("no git"), subprocess.TimeoutExpired("git", 10)])
def test_git_failing_gives_null_commit(common, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure):
    def run(*args, **kwargs):
        raise failure

    monkeypatch.setattr(subprocess, "run", run)  # wherever git is called from
    assert common.run_meta()["commit"] is None


def test_not_a_git_checkout_gives_null_commit(common, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path counts
    monkeypatch.setattr(common, "REPO", tmp_path)
    assert common.git_state() == (None, None)


def test_write_replaces_whole_and_leaves_no_temporary_files(common, repo, tmp_path: Path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "bench.json").write_text('{"old": "layout", "padding": "' + "x" * 10_000 + '"}\n')
    (folder / "bench.md").write_text("old\n" * 1000)
    (folder / "bench.md").chmod(0o640)
    data, md = _write_rows(common, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["bench.json", "bench.md"]
    assert "old" not in data and json.loads((folder / "bench.json").read_text()) == data
    assert md.startswith("# bench\n") and "old" not in md
    assert (folder / "bench.md").stat().st_mode & 0o777 == 0o640  # the mode it had, not mkstemp's 0600
    _write_rows(common, tmp_path / "fresh")
    assert (tmp_path / "fresh" / "bench.json").stat().st_mode & 0o777 == 0o644


def test_failed_write_keeps_the_old_file(common, repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "bench.json").write_text('{"old": 1}\n')
    moves = []

    def failing_replace(src, dst):
        moves.append((Path(src), Path(dst)))
        raise OSError("disk full")

    monkeypatch.setattr(common.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        _write_rows(common, folder)
    assert moves and moves[0][0].parent == folder and moves[0][1] == folder / "bench.json"  # a temporary beside it
    assert json.loads((folder / "bench.json").read_text()) == {"old": 1}
    assert [p.name for p in folder.iterdir()] == ["bench.json"]


def test_copy_into_out(common, repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OUT", str(tmp_path / "device_out"))
    data, md = _write_rows(common, tmp_path / "results")
    assert json.loads((tmp_path / "device_out" / "bench.json").read_text()) == data
    assert (tmp_path / "device_out" / "bench.md").read_text() == md


def test_kernel_breakdown_groups_per_call(common) -> None:
    # GPU kernel names as the profiler reports them, 2 calls: ms per call by group, our Triton kernels first
    kernels = {"_gemm_kernel": [50.0, 50.0], "sm90_xmma_gemm_f16f16_f32": [30.0, 30.0],
               "triton_per_fused_native_layer_norm_3": [4.0, 4.0, 4.0, 4.0],
               "triton_poi_fused_convolution_relu_1": [4.0, 4.0],
               "pytorch_flash::flash_fwd_kernel": [20.0, 20.0], "Memcpy DtoD": [1.0, 1.0], "elementwise": [2.0, 2.0]}
    out = common.kernel_breakdown(kernels, calls=2, top=3)
    assert out["groups_ms"] == {"overdrive int8/fp8 (Triton)": 0.05, "GEMM (cuBLAS/CUTLASS)": 0.03,
                                "attention": 0.02, "Inductor Triton": 0.012, "other": 0.002, "copies": 0.001}
    assert list(out["groups_ms"])[0] == "overdrive int8/fp8 (Triton)"  # largest first
    assert out["top"] == [["_gemm_kernel", 0.05, 1.0], ["sm90_xmma_gemm_f16f16_f32", 0.03, 1.0],
                          ["pytorch_flash::flash_fwd_kernel", 0.02, 1.0]]
