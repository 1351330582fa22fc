"""`overdrive demo` at the front door: stages run in their order once, a Ctrl-C keeps what the finished stages
measured (JSON and report) and exits 130 with one line, and a report folder holds no chart of an older run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

from overdrive import demo  # noqa: E402
from overdrive._utils.table import Table  # noqa: E402


def _fakes(monkeypatch: pytest.MonkeyPatch, order: list[str], transformer=None) -> None:  # noqa: ANN001
    """Stand-in stages (their own tests run the real ones) that record the order they ran in."""
    from overdrive.demo import amp_stage, data_stage, distributed_stage, quant_stage, transformer_stage

    def amp(ctx):  # noqa: ANN001
        order.append("amp")
        ctx.fp32_model = object()
        return Table("amp", ["run"], [["x"]], curves={"O0": [1.0, 0.5]})

    def quant(ctx):  # noqa: ANN001
        order.append("quant")
        assert ctx.fp32_model is not None, "quant ran before amp"
        return Table("quant", ["run"], [["x"]])

    def plain(name: str):  # noqa: ANN202
        return lambda ctx: order.append(name) or Table(name, ["run"], [["x"]])

    monkeypatch.setattr(amp_stage, "run", amp)
    monkeypatch.setattr(quant_stage, "run", quant)
    monkeypatch.setattr(data_stage, "run", plain("data"))
    monkeypatch.setattr(distributed_stage, "run", plain("distributed"))
    monkeypatch.setattr(transformer_stage, "run", transformer or plain("transformer"))


def test_stages_run_in_order_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--stage quant --stage amp --stage quant` ran quant before the amp model it needs existed (failed), then
    quant again."""
    order: list[str] = []
    _fakes(monkeypatch, order)
    tables = demo.run_demo(device="cpu", opt_levels=("O0",), epochs=1, stages=["quant", "amp", "quant"],
                           progress=False, quick=True)
    assert order == ["amp", "quant"]
    assert [t.status for t in tables] == ["ok", "ok"]


def test_ctrl_c_keeps_finished_stages_and_exits_130(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C in the third stage threw away the first two stages' results (no --json, no --report) and said
    'aborted' with exit 1."""
    pytest.importorskip("matplotlib")
    from overdrive.cli.main import main

    def interrupted(ctx):  # noqa: ANN001
        raise KeyboardInterrupt

    _fakes(monkeypatch, [], transformer=interrupted)
    out, rep = tmp_path / "r.json", tmp_path / "rep"
    code = main(["demo", "--quick", "--no-progress", "--stage", "data", "--stage", "amp", "--stage", "transformer",
                 "--json", str(out), "--report", str(rep)])
    err = capsys.readouterr().err
    assert code == 130
    assert "error: interrupted" in err and "Traceback" not in err
    saved = json.loads(out.read_text())
    assert [(t["stage"], t["status"]) for t in saved["tables"]] == [("amp", "ok"), ("transformer", "interrupted")]
    assert "interrupted: transformer" in saved["summary"] and "data" not in saved["summary"]
    assert "interrupted" in (rep / "report.md").read_text()


def test_ctrl_c_in_the_first_stage_leaves_an_older_json_alone(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    from overdrive.cli.main import main

    def interrupted(ctx):  # noqa: ANN001
        raise KeyboardInterrupt

    _fakes(monkeypatch, [], transformer=interrupted)
    out = tmp_path / "r.json"
    out.write_text('{"older": true}\n')
    assert main(["demo", "--quick", "--no-progress", "--stage", "transformer", "--json", str(out)]) == 130
    assert json.loads(out.read_text()) == {"older": True}


def test_summary_names_the_interrupted_stage() -> None:
    tables = [Table("a", [], stage="amp"), Table("t", [], stage="transformer", status="interrupted")]
    assert demo.summary(tables) == ("demo: 1 of 2 stage(s) ran; interrupted: transformer", False)


def test_report_folder_keeps_no_chart_of_an_older_run(tmp_path: Path) -> None:
    """A report over an older one left the older run's loss_<stage>.png beside it; the user's own files stay."""
    pytest.importorskip("matplotlib")
    from overdrive.demo.plots import write_report

    write_report([Table("amp", ["run"], [["x"]], stage="amp", curves={"O0": [1.0, 0.5]})], tmp_path)
    (tmp_path / "mine.png").write_bytes(b"the user's")
    assert (tmp_path / "loss_amp.png").is_file()
    write_report([Table("data", ["run"], [["x"]], stage="data")], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.png", "report.json", "report.md"]
