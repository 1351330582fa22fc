"""The demo's transformer stage on the --quick CPU workload: a row per run and sequence length for eager,
torch.compile and each engine precision, fp32 engines at the eager fp32 model's hidden states (token cosine
>= 0.999) and int8 within the engines' own bar (>= 0.99), ratios against the baselines of the same run, a
candidate that fails as a row, the chart's speed-ups, and a clean skip without transformers."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from overdrive._utils.table import Table

pytest.importorskip("sklearn")  # run_demo loads the digits


@pytest.fixture(scope="module")
def table() -> Iterator[Table]:
    pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime")
    from overdrive.demo import run_demo, transformer_stage

    real = transformer_stage._candidates
    with pytest.MonkeyPatch.context() as mp:  # one candidate that cannot build here (fp8 on a CPU)
        mp.setattr(transformer_stage, "_candidates", lambda cuda, fp8: real(cuda, fp8) + [("fp8", "onnxruntime")])
        tables = run_demo(device="cpu", stages=["transformer"], progress=False, quick=True)
    assert [t.stage for t in tables] == ["transformer"]  # alone: no amp stage trained first
    yield tables[0]


def _rows(table: Table) -> dict[tuple[str, str, int | None], dict]:
    return {(r[0], r[1], r[2]): dict(zip(table.columns, r)) for r in table.rows}


def test_quick_cpu_rows_accuracy_and_ratios(table: Table) -> None:
    from overdrive.demo.workloads import choose_transformer

    assert table.status == "ok", table.rows
    seqs = choose_transformer(torch.device("cpu"), quick=True).seqs
    rows = _rows(table)
    eager = "PyTorch eager fp32"
    comp = "torch.compile(mode='default', dynamic=True)"
    for s in seqs:
        e, c = rows[(eager, "-", s)], rows[(comp, "-", s)]
        assert e["vs eager"] == 1.0 and c["vs torch.compile"] == 1.0
        assert e["token cosine"] > 0.99999 and c["token cosine"] > 0.999
        for prec, bar in (("fp32", 0.999), ("int8", 0.99)):
            r = rows[(f"engine {prec}", "onnxruntime", s)]
            assert r["note"] is None and r["token cosine"] >= bar, r
            assert r["vs eager"] == pytest.approx(e["median ms"] / r["median ms"])
            assert r["vs torch.compile"] == pytest.approx(c["median ms"] / r["median ms"])
            assert r["build s"] > 0
            lo, hi = (float(v) for v in r["ms IQR"].split("-"))  # the middle half of the calls, around the median
            assert lo <= r["median ms"] * 1.01 and r["median ms"] <= hi * 1.01
        assert rows[("engine int8", "onnxruntime", s)]["build cosine"] >= 0.99  # engine.info["accuracy"]
        assert rows[("engine fp32", "onnxruntime", s)]["build cosine"] > 0.9999  # float builds are checked too
    failed = rows[("engine fp8", "onnxruntime", None)]
    assert failed["note"].startswith("BUILD FAILED: UsageError") and "fp8" in failed["note"]
    labels = {(s["label"], s["baseline"]) for s in table.speedups}
    S = max(seqs)
    assert {(f"engine {p} seq {S}", b) for p in ("fp32", "int8") for b in (eager, "torch.compile")} <= labels
    assert all(s["ratio"] > 0 for s in table.speedups)


def test_build_cosine_note_says_what_each_check_ran_on(table: Table) -> None:
    """fp32 engines fill the column too, checked on the example inputs, not calibration batches."""
    note = next(n for n in table.notes if "build cosine:" in n)
    assert "engine fp32 on example inputs" in note and "engine int8 on calibration data" in note
    assert "int8/fp8, on calibration batches" not in note


def test_check_note_names_the_worst_sample() -> None:
    from overdrive.demo.transformer_stage import check_note

    acc = {"passed": False, "cosine": 0.999, "min_cosine": 0.99, "worst_cosine": 0.42, "min_worst_cosine": 0.9}
    assert check_note(acc) == "build check failed: worst sample's cosine 0.4200 below 0.9"
    assert check_note({**acc, "cosine": 0.95}) == "below the build check's min cosine 0.99"


def test_in_the_report(table: Table, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import json

    from overdrive.demo.plots import write_report

    path = write_report([table], tmp_path)
    md = path.read_text()
    assert "### Transformer engines (overdrive.engine): tiny BERT" in md and "| engine int8 | onnxruntime |" in md
    shown = json.loads((tmp_path / "report.json").read_text())["charts"]["speedups.png"]["labels"]
    assert "transformer: engine fp32 seq 32 vs torch.compile" in shown


def test_skipped_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.demo import run_demo, summary

    monkeypatch.setitem(sys.modules, "transformers", None)  # importlib finds no spec: as if not installed
    tables = run_demo(device="cpu", stages=["transformer"], progress=False, quick=True)
    assert [(t.stage, t.status) for t in tables] == [("transformer", "skipped")]
    why = tables[0].rows[0][2]
    assert "needs the optional package 'transformers'" in why and "[text]" in why  # the pip extra
    assert summary(tables) == ("demo: 0 of 1 stage(s) ran; skipped: transformer", False)


def test_transformer_workloads() -> None:
    pytest.importorskip("transformers")
    from overdrive.demo.transformer_stage import make_batch
    from overdrive.demo.workloads import choose_transformer

    gpu, cpu = choose_transformer(torch.device("cuda"), quick=False), choose_transformer(torch.device("cpu"), False)
    assert (gpu.hidden, gpu.layers, gpu.batch, gpu.max_seq) == (768, 12, 8, 128)
    assert (cpu.hidden, cpu.layers) == (384, 6) and cpu.max_seq < gpu.max_seq
    quick = choose_transformer(torch.device("cpu"), quick=True)
    state = torch.random.get_rng_state()
    a, b = quick.make_model(seed=3), quick.make_model(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    ids, mask = make_batch(quick, 32, seed=0)
    assert ids.shape == mask.shape == (quick.batch, 32) and int(ids.min()) >= 1
    assert mask[:, :16].all() and not mask[-1].all()  # every row keeps half, the last is padded
