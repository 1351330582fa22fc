"""The demo's tables agree with themselves and with the report: chart labels read as the rows do, a stage whose
starting model could not be trained is skipped with the reason, a batch no bigger than the data, and a reference
row that is never blank."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")

from overdrive import demo  # noqa: E402
from overdrive._utils.errors import UsageError  # noqa: E402
from overdrive._utils.table import Table  # noqa: E402


@pytest.fixture(scope="module")
def digits():  # type: ignore[no-untyped-def]
    from overdrive.recipes.data import load_digits

    return load_digits(seed=0)


def _ctx(digits, **kw):  # type: ignore[no-untyped-def]
    from overdrive.demo.context import DemoContext

    return DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=digits, epochs=1, progress=False, **kw)


def test_quant_chart_labels_read_as_the_rows_after_ties(monkeypatch: pytest.MonkeyPatch, digits) -> None:  # noqa: ANN001
    """Tied PTQ calibrators are relabelled "(tied best)" in the table; the accuracy chart's labels were taken before
    that, so the chart said "max (best)" beside a table where six calibrators tie and "max" is one of them."""
    from overdrive.demo import quant_stage

    rows = [["fp32", "-", 0.9, 0.0], ["int8 PTQ", "max (best)", 0.9, 0.0], ["int8 PTQ", "mse", 0.9, 0.0],
            ["int8 PTQ", "entropy", 0.8, -10.0], ["int8 QAT (1 epoch(s))", "max", 0.9, 0.0]]

    def fake_table(title, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        return Table(title, ["model", "calibration", "test accuracy", "vs fp32 (points)"], [list(r) for r in rows]), \
            None, []

    monkeypatch.setattr(quant_stage, "accuracy_table", fake_table)
    table = quant_stage.run(_ctx(digits, fp32_model=torch.nn.Identity(), fp32_accuracy=0.9))
    assert [r[1] for r in table.rows[1:4]] == ["max (tied best)", "mse (tied best)", "entropy"]
    labels = [s["label"] for s in table.speedups]
    assert labels == [f"{r[0]} ({r[1]})" for r in table.rows[1:]]
    assert [s["accuracy_delta"] for s in table.speedups] == [r[3] for r in table.rows[1:]]


def test_a_batch_bigger_than_the_training_set_is_refused_before_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every training batch is a full one: a batch over the 1438 training images left none, and the amp stage
    failed on torch's "Expected positive integer total_steps, but got 0" (and every stage after it with it)."""
    from overdrive.demo import amp_stage

    monkeypatch.setattr(amp_stage, "run", lambda ctx: pytest.fail("a stage ran"))
    with pytest.raises(UsageError, match=r"--batch-size 5000 is more than the 1438 training images; use at most 1438"):
        demo.run_demo(device="cpu", batch_size=5000, stages=["amp"], quick=True, progress=False)

    import contextlib
    import io

    from overdrive.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["demo", "--quick", "--no-progress", "--stage", "amp", "--batch-size", "1439"])
    assert code == 2 and "--batch-size 1439 is more than the 1438 training images" in err.getvalue()


def test_stages_after_a_failed_amp_are_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """quant, sparsity and engine start from amp's O0 model: when amp failed they each failed as well, with
    "needs the amp stage's O0 model (run_demo adds it)" (the engine stage trained the model again, to fail the
    same way); now they are skipped, saying amp failed, and a stage with its own model still runs."""
    from overdrive.demo import amp_stage, data_stage, engine_stage, quant_stage

    ran: list[str] = []

    def boom(ctx):  # noqa: ANN001, ANN202
        raise ValueError("Expected positive integer total_steps, but got 0")

    monkeypatch.setattr(amp_stage, "run", boom)
    monkeypatch.setattr(quant_stage, "run", lambda ctx: ran.append("quant"))
    monkeypatch.setattr(engine_stage, "run", lambda ctx: ran.append("engine"))
    monkeypatch.setattr(data_stage, "run", lambda ctx: ran.append("data") or Table("d", ["x"], [[1]]))
    tables = demo.run_demo(device="cpu", stages=["quant", "engine", "data"], quick=True, progress=False)
    assert ran == ["data"]
    assert [(t.stage, t.status) for t in tables] == [("amp", "failed"), ("quant", "skipped"), ("engine", "skipped"),
                                                     ("data", "ok")]
    assert "the 'amp' stage, whose O0-trained fp32 model this stage starts from, failed" in tables[1].rows[0][2]
    assert demo.summary(tables) == ("demo: 1 of 4 stage(s) ran; failed: amp; skipped: quant, engine", True)


def test_data_stage_alone_has_a_reference_accuracy(monkeypatch: pytest.MonkeyPatch, digits) -> None:  # noqa: ANN001
    """`overdrive demo --quick --stage data` printed "-" as the in-memory reference's accuracy: it was the amp
    stage's, which does not run before the data stage alone. It is then trained as the PNG run is."""
    from overdrive.demo import data_stage

    calls: list[tuple[int, int]] = []

    def reference(ctx, epochs, bs):  # noqa: ANN001, ANN202
        calls.append((epochs, bs))
        return 0.75

    class Trainer:  # the PNG run's training: its own tests run it; here only the reference row is looked at
        def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
            pass

        def fit(self, *a, **kw):  # noqa: ANN002, ANN003, ANN202
            from types import SimpleNamespace

            return SimpleNamespace(history=[SimpleNamespace(eval_accuracy=0.7)], final_loss=1.0, samples_per_s=1.0)

    monkeypatch.setattr(data_stage, "_tensor_reference", reference)
    monkeypatch.setattr(data_stage, "Trainer", Trainer)
    table = data_stage.images_table(_ctx(digits))
    assert calls == [(1, 64)]
    assert table.rows[0][:2] == ["digits CNN, 8x8 tensors in memory (reference)", 0.75]
    # after the amp stage, the quick demo compares with the accuracy it reached
    table = data_stage.images_table(_ctx(digits, fp32_accuracy=0.5))
    assert table.rows[0][:2] == ["tensors in memory (amp stage, O0)", 0.5] and len(calls) == 1


def test_report_summary_names_each_stage_once_as_the_summary_line_does(tmp_path) -> None:  # noqa: ANN001
    """The data stage gives two tables: both failed read "failed: data, data" in report.md, and one failed, one
    skipped "failed: data; skipped: data", where the terminal's last line names data once, as failed."""
    pytest.importorskip("matplotlib")
    from overdrive.demo.plots import write_report

    tables = [Table("amp", ["x"], [[1]], stage="amp"),
              Table("images", ["x"], [[1]], stage="data", status="failed"),
              Table("tokens", ["x"], [[1]], stage="data", status="skipped"),
              Table("bert", ["x"], [[1]], stage="transformer", status="skipped"),
              Table("ranks", ["x"], [[1]], stage="distributed", status="failed"),
              Table("ranks", ["x"], [[1]], stage="distributed", status="failed")]
    md = write_report(tables, tmp_path).read_text()
    assert md.rstrip().splitlines()[-1] == "**Summary:** failed: data, distributed; skipped: transformer."
    assert demo.summary(tables)[0] == "demo: 1 of 4 stage(s) ran; failed: data, distributed; skipped: transformer"


def test_engine_speedups_change_accuracy_against_the_eager_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the eager baseline runs fp16 and scores apart from the fp32 model: the speed-ups "vs PyTorch eager"
    carried the change against fp32 instead, so the chart's points were not the table's eager row's."""
    pytest.importorskip("onnxruntime")
    from overdrive.demo import engine_stage
    from overdrive.engine import Engine

    real = engine_stage._accuracy

    def skewed(fn, ctx, batch, pad=False):  # noqa: ANN001, ANN202 - eager scores 1 point under the fp32 model
        acc = real(fn, ctx, batch, pad)
        plain = isinstance(fn, torch.nn.Module) and not isinstance(fn, Engine) and not hasattr(fn, "_orig_mod")
        return acc - 0.01 if plain else acc

    monkeypatch.setattr(engine_stage, "_accuracy", skewed)
    table = demo.run_demo(device="cpu", stages=["engine"], progress=False, quick=True, epochs=1)[-1]
    assert table.stage == "engine" and table.status == "ok", table.rows
    acc = {r[0]: r[2] for r in table.rows}
    eager = next(k for k in acc if k.startswith("PyTorch eager"))
    against = [s for s in table.speedups if s["baseline"] == eager]
    assert len(against) == 3  # torch.compile, engine fp32, engine int8
    for s in against:
        row = next(k for k in acc if k.startswith(s["label"]))
        assert s["accuracy_delta"] == pytest.approx(100 * (acc[row] - acc[eager])), s
