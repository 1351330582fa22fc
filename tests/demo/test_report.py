"""The demo's markdown report: every table's rows, flagged statuses, a summary, and valid PNG charts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from overdrive._utils.errors import MissingDependencyError
from overdrive.demo.plots import write_report
from overdrive._utils.table import Table

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tables() -> list[Table]:
    amp = Table("AMP opt levels", ["level", "accuracy", "step ms"], [["O0", 0.97, 12.0], ["O2", 0.968, 7.9]],
                stage="amp")
    amp.add_speedup("O2", 1.52, "O0", accuracy_delta=-0.1)
    amp.add_speedup("O3", 0.8, "O0")
    amp.curves = {"O0": [2.3, 0.9, 0.1], "O3": [2.3, 40.0, math.nan, math.nan]}  # O3 diverged at epoch 3
    quant = Table("INT8 quantization", ["mode", "accuracy"], [["int8", 0.955]], stage="quant", status="failed",
                  notes=["calibration raised"])
    quant.add_speedup("int8", 2.1, "fp32", accuracy_delta=0.3)
    dist = Table("Distributed", ["world", "step ms"], [], stage="distributed", status="skipped",
                 notes=["needs 2 GPUs, found 0"])
    return [amp, quant, dist]


def _info(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _check_png(path: Path, height_px: int) -> None:
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert path.stat().st_size < 200_000
    pixels = image.imread(path)  # (H, W, 4)
    assert pixels.shape[0] == height_px > 100


def test_report_holds_every_table_and_the_summary(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    tables = _tables()
    path = write_report(tables, tmp_path / "new" / "dir", {"device": "cpu", "torch": "2.13.0", "git_commit": "abc123"})
    md = path.read_text()
    assert path == tmp_path / "new" / "dir" / "report.md"
    assert md.startswith("# ")
    assert "- device: cpu" in md and "- git_commit: abc123" in md
    for t in tables:
        rendered = t.to_markdown().splitlines()
        for line in [rendered[0]] + [ln for ln in rendered if ln.startswith("| ") or ln.startswith("- ")]:
            assert line in md, line
    assert "| O2 | 0.9680 | 7.900 |" in md
    # the status flag sits right under its table's heading, and only there
    assert "### INT8 quantization\n\n**failed**\n" in md
    assert "### Distributed\n\n**skipped**\n" in md
    assert "### AMP opt levels\n\n| level" in md
    assert md.rstrip().splitlines()[-1] == "**Summary:** failed: quant; skipped: distributed."
    for name in ("speedups.png", "accuracy.png", "loss_amp.png"):
        assert f"]({name})" in md
    # atomic writes leave no temporary files behind
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "accuracy.png", "loss_amp.png", "report.json", "report.md", "speedups.png"]


def test_charts_are_valid_pngs_showing_the_right_bars(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_report(_tables(), tmp_path)
    charts = _info(tmp_path)["charts"]
    assert set(charts) == {"speedups.png", "accuracy.png", "loss_amp.png"}
    for name, chart in charts.items():
        _check_png(tmp_path / name, chart["height_px"])
    assert charts["speedups.png"]["labels"] == ["amp: O2 vs O0", "amp: O3 vs O0", "quant: int8 vs fp32"]
    assert charts["speedups.png"]["texts"] == ["1.52x (-0.1 pt)", "0.80x", "2.10x (+0.3 pt)"]
    # O3 has no accuracy delta, so it has no accuracy bar
    assert charts["accuracy.png"]["labels"] == ["amp: O2 vs O0", "quant: int8 vs fp32"]
    assert charts["accuracy.png"]["values"] == pytest.approx([-0.1, 0.3])


def test_chart_height_grows_with_the_number_of_bars(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    t = Table("many", ["x"], [[1]], stage="many")
    for i in range(20):
        t.add_speedup(f"v{i}", 1.0 + i / 10, "base")
    write_report([t], tmp_path)
    tall = _info(tmp_path)["charts"]["speedups.png"]["height_px"]
    _check_png(tmp_path / "speedups.png", tall)
    write_report(_tables()[:1], tmp_path)
    assert _info(tmp_path)["charts"]["speedups.png"]["height_px"] < tall


def test_diverged_curve_is_drawn_and_labelled(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    t = Table("AMP", ["level"], [["O0"]], stage="amp")
    t.curves = {"O0": [1.0, 0.8, 0.7], "O2": [1.0, math.inf], "O3": [math.nan, math.nan]}
    write_report([t], tmp_path)
    chart = _info(tmp_path)["charts"]["loss_amp.png"]
    assert chart["legend"] == ["O0", "O2 (diverged)", "O3 (diverged)"]
    assert chart["yscale"] == "linear"  # 0.7 .. 1.0 spans less than 10x
    _check_png(tmp_path / "loss_amp.png", chart["height_px"])


def test_loss_uses_log_scale_only_when_positive_and_spanning_10x(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_report(_tables()[:1], tmp_path)  # 0.1 .. 40 once the NaNs are cut
    assert _info(tmp_path)["charts"]["loss_amp.png"]["yscale"] == "log"
    t = Table("T", ["x"], [[1]], stage="t")
    t.curves = {"a": [100.0, 1.0, 0.0]}  # a zero loss cannot go on a log axis
    write_report([t], tmp_path)
    assert _info(tmp_path)["charts"]["loss_t.png"]["yscale"] == "linear"


def test_no_speedups_means_no_speedup_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    write_report(_tables(), tmp_path)  # an earlier run in the same folder drew both charts
    assert (tmp_path / "speedups.png").exists()
    t = Table("Data loading", ["loader", "img/s"], [["gpu", 5000.0]], stage="data")
    path = write_report([t], tmp_path)
    md = path.read_text()
    assert not (tmp_path / "speedups.png").exists()
    assert not (tmp_path / "accuracy.png").exists()
    assert "no speed-up chart" in md and "no accuracy chart" in md
    assert "](speedups.png)" not in md
    assert "| gpu | 5,000 |" in md
    assert md.rstrip().splitlines()[-1] == "**Summary:** every stage ran."
    assert _info(tmp_path)["charts"] == {}


def test_missing_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(MissingDependencyError, match=r"\[plot\]"):
        write_report(_tables(), tmp_path)
    assert not (tmp_path / "report.md").exists()


def test_accuracy_chart_keeps_accuracy_only_rows(tmp_path: Path) -> None:
    """quant and sparsity record accuracy changes with no speed (a NaN ratio): no speed-up bar, an accuracy bar."""
    pytest.importorskip("matplotlib")
    sparse = Table("2:4", ["model", "vs dense (points)"], [["2:4 pruned", -89.7]], stage="sparsity")
    sparse.add_speedup("2:4 pruned", float("nan"), "dense", accuracy_delta=-89.7)
    write_report([*_tables()[:1], sparse], tmp_path)
    charts = _info(tmp_path)["charts"]
    assert charts["speedups.png"]["labels"] == ["amp: O2 vs O0", "amp: O3 vs O0"]
    assert charts["accuracy.png"]["labels"] == ["amp: O2 vs O0", "sparsity: 2:4 pruned vs dense"]
    assert charts["accuracy.png"]["values"] == pytest.approx([-0.1, -89.7])
