"""benchmarks/engine_zoo.py: the quick CPU run writes a table with every key, accuracy in range and ratios
from the same run; the zoo summary's geomeans, minima and target verdicts are computed, not assumed; split runs
merge into one summary."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_zoo.py"


@pytest.fixture(scope="module")
def zoo():
    # benchmarks/ is not a package: load the script under a name no other module uses
    sys.path.insert(0, str(_PATH.parent))
    spec = importlib.util.spec_from_file_location("overdrive_benchmarks_engine_zoo", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _no_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUT", raising=False)  # the lent GPU machine sets it; the writer copies into it


@pytest.mark.slow
def test_quick_cpu_run(zoo, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    threads = torch.get_num_threads()
    # torch.compile rows are left out: on 2 CPU cores each compile takes 10-15 s
    rc = zoo.main(["--device", "cpu", "--quick", "--models", "resnet50,bert", "--out-dir", str(tmp_path),
                   "--configs", "eager_fp16,engine_fp16,engine_int8,engine_fp8"])
    assert rc == 0
    assert torch.get_num_threads() == threads  # the quick run's one thread is put back
    data = json.loads((tmp_path / "engine_zoo_quick.json").read_text())
    md = (tmp_path / "engine_zoo_quick.md").read_text()
    assert data["meta"]["quick"] is True and data["meta"]["device"].startswith("CPU")
    rows = data["results"]["rows"]
    assert {(r["model"], r["config"]) for r in rows} == {
        (m, c) for m in ("resnet50", "bert") for c in ("eager_fp16", "engine_fp16", "engine_int8", "engine_fp8")}
    for r in rows:
        assert r["batch"] == 2 and r["batch_kind"] == "serving"
        if r["config"] == "engine_fp8":  # no fp8 on a CPU: a row that says so, and the run goes on
            assert r["error"].startswith("skipped: fp8 needs") and r.get("ms") is None
            continue
        assert not r.get("error"), r
        assert r["ms"] > 0 and r["throughput"] == pytest.approx(2 / (r["ms"] / 1e3), rel=1e-2)
        assert -1.0 <= r["cosine"] <= 1.0 and r["cosine"] > 0.99, r  # fp32 and int8 of tiny models on CPU
        assert math.isfinite(r["max_abs_err"]) and r["max_abs_err"] >= 0
        if r["config"].startswith("engine"):
            assert r["build_s"] >= 0 and r["precision"] in ("fp32", "int8")
            assert r["x_vs_engine_fp16"] > 0
            assert "kept_float" in r and "layer_placement" in r  # each layer's verdict, for the profile after
        assert "x_vs_ro" not in r  # no reduce-overhead row in this run: no ratio against it
    assert all(c in md for c in zoo.COLUMNS) and "Zoo summary" in md
    s = data["results"]["summary"]
    assert {e["model"] for e in s["per_model"]} == {"resnet50", "bert"}
    assert s["by_batch"]["all"]["fp16_vs_ro"] == {"n": 0, "met": None}
    low = s["by_batch"]["all"]["lowp_vs_fp16"]
    assert low["n"] == 2 and low["met"] in (True, False) and low["min"] <= low["geomean"]


def _row(model: str, config: str, ms: float, kind: str = "serving", **kw) -> dict:
    return {"model": model, "batch": 8, "batch_kind": kind, "config": config, "ms": ms, **kw}


def test_summary_is_computed(zoo) -> None:
    rows = [_row("a", "engine_fp16", 1.0, x_vs_ro=2.0, build_s=30.0),
            _row("a", "engine_int8", 0.5, x_vs_engine_fp16=2.0, cosine=0.999, build_s=50.0),
            _row("a", "engine_fp8", 0.4, x_vs_engine_fp16=2.5, cosine=0.95),  # faster but inaccurate: not the best
            _row("b", "engine_fp16", 1.0, x_vs_ro=0.5),
            _row("b", "engine_fp8", 0.9, x_vs_engine_fp16=1.1, cosine=0.995),
            _row("b", "engine_int8", None, error="RuntimeError: boom"),  # a failed row counts for nothing
            _row("a", "engine_fp16", 1.0, kind="1", x_vs_ro=1.5, build_s=130.0)]
    s = zoo.summarize(rows)
    per = {(e["model"], e["batch_kind"]): e for e in s["per_model"]}
    assert per[("a", "serving")]["best_lowp"] == "engine_int8" and per[("a", "serving")]["lowp_vs_fp16"] == 2.0
    assert per[("b", "serving")]["best_lowp"] == "engine_fp8"
    serving = s["by_batch"]["serving"]
    assert serving["fp16_vs_ro"]["geomean"] == pytest.approx(1.0) and serving["fp16_vs_ro"]["min"] == 0.5
    assert serving["fp16_vs_ro"]["min_at"] == "b@serving" and serving["fp16_vs_ro"]["met"] is False
    assert serving["lowp_vs_fp16"]["geomean"] == pytest.approx(math.sqrt(2.0 * 1.1), abs=1e-3)
    assert serving["lowp_vs_fp16"]["met"] is True  # >= 1.4x geomean, >= 1.0x everywhere, cosine >= 0.99
    assert s["by_batch"]["all"]["fp16_vs_ro"]["n"] == 3
    assert s["by_batch"]["all"]["max_engine_build_s"] == 130.0
    assert s["by_batch"]["1"]["fp16_vs_ro"]["met"] is True
    lines = zoo.summary_lines(s)
    assert any("[serving]" in ln and "NOT met" in ln and "compile" in ln for ln in lines)
    assert any("slowest engine build 130 s" in ln and "NOT met" in ln for ln in lines)


def test_split_runs_merge(zoo, tmp_path: Path) -> None:
    facts = zoo.device_facts(torch.device("cpu"))
    zoo.write("engine_zoo_a", tmp_path, facts, [_row("a", "engine_fp16", 1.0, x_vs_ro=2.0)], [])
    zoo.write("engine_zoo_b", tmp_path, facts, [_row("b", "engine_fp16", 1.0, x_vs_ro=0.5)], [])
    assert zoo.main(["--merge", str(tmp_path / "engine_zoo_*.json"), "--out", "engine_zoo",
                     "--out-dir", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "engine_zoo.json").read_text())
    assert sorted(merged["meta"]["merged_from"]) == ["engine_zoo_a.json", "engine_zoo_b.json"]
    assert merged["results"]["summary"]["by_batch"]["all"]["fp16_vs_ro"]["geomean"] == pytest.approx(1.0)


def test_merge_keeps_the_compile_pairing_and_names_each_rows_device(zoo, tmp_path: Path) -> None:
    # a later run without torch.compile beside its fp16 engine adds its int8 row but leaves the paired fp16 row;
    # rows from two GPUs carry a device column
    h200 = {**zoo.device_facts(torch.device("cpu")), "device": "GPU A"}
    h100 = {**zoo.device_facts(torch.device("cpu")), "device": "GPU B"}
    zoo.write("engine_zoo_a", tmp_path, h200, [_row("m", "engine_fp16", 1.0, x_vs_ro=1.5),
                                               _row("m", "engine_int8", 1.0, x_vs_engine_fp16=0.9)], [])
    zoo.write("engine_zoo_b", tmp_path, h100, [_row("m", "engine_fp16", 1.0),
                                               _row("m", "engine_int8", 1.0, x_vs_engine_fp16=1.2)], [])
    assert zoo.main(["--merge", str(tmp_path / "engine_zoo_a.json") + "," + str(tmp_path / "engine_zoo_b.json"),
                     "--out", "engine_zoo", "--out-dir", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "engine_zoo.json").read_text())
    rows = {r["config"]: r for r in merged["results"]["rows"]}
    assert rows["engine_fp16"]["x_vs_ro"] == 1.5 and rows["engine_fp16"]["device"] == "GPU A"
    assert rows["engine_int8"]["x_vs_engine_fp16"] == 1.2 and rows["engine_int8"]["device"] == "GPU B"
    assert "GPU A; GPU B" in merged["meta"]["device"]
    assert "| device |" in (tmp_path / "engine_zoo.md").read_text()


def test_quantized_residual_configs_count_as_low_precision(zoo) -> None:
    # engine_int8_qres / engine_fp8_qres (opt-in configs) take part in the best-low-precision summary
    rows = [_row("a", "engine_fp16", 1.0, x_vs_ro=1.5, build_s=30.0),
            _row("a", "engine_int8", 1.2, x_vs_engine_fp16=0.85, cosine=0.999),
            _row("a", "engine_int8_qres", 0.8, x_vs_engine_fp16=1.25, cosine=0.998)]
    e = zoo.summarize(rows)["per_model"][0]
    assert e["best_lowp"] == "engine_int8_qres" and e["lowp_vs_fp16"] == 1.25
    assert "engine_fp8_qres" not in zoo.CONFIGS and "engine_fp8_qres" in zoo.EXTRA_CONFIGS


def test_summary_counts_low_precision_rows_that_run_their_float_build(zoo) -> None:
    # an int8/fp8 build whose whole-engine timing (or per-layer timing) kept the float program is counted and said
    rows = [_row("a", "engine_fp16", 1.0, x_vs_ro=1.5),
            _row("a", "engine_int8", 1.0, x_vs_engine_fp16=0.99, cosine=0.9999, runs_float=True),  # whole engine
            _row("b", "engine_fp16", 1.0, x_vs_ro=1.5),
            _row("b", "engine_fp8", 0.8, x_vs_engine_fp16=1.2, cosine=0.999, runs_float=False),
            _row("c", "engine_fp16", 1.0, x_vs_ro=1.5),
            _row("c", "engine_int8", 1.0, x_vs_engine_fp16=1.0, cosine=1.0, runs_float=True)]  # every layer float
    s = zoo.summarize(rows)
    per = {e["model"]: e["lowp_runs_float"] for e in s["per_model"]}
    assert per == {"a": True, "b": False, "c": True}
    assert s["by_batch"]["all"]["lowp_vs_fp16"]["runs_float"] == 2
    assert any("2 of the 3 run their float build" in ln for ln in zoo.summary_lines(s))
