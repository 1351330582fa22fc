"""`overdrive demo` refuses before any work what it would otherwise ignore or lose: a flag none of the chosen stages
uses, a --json path the --report folder would take; and its report records the command that reproduces the run."""

from __future__ import annotations

import importlib
import json
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")

from overdrive._utils.errors import UsageError  # noqa: E402
from overdrive._utils.table import Table  # noqa: E402
from overdrive.demo import STAGES, run_demo  # noqa: E402


@pytest.fixture(scope="module")
def digits():  # type: ignore[no-untyped-def]
    from overdrive.recipes.data import load_digits

    return load_digits(seed=0)


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch, digits) -> list[str]:  # type: ignore[no-untyped-def]
    """Every stage replaced by a stand-in that records that it ran (their own tests run the real ones)."""
    monkeypatch.setattr("overdrive.demo.load_digits", lambda seed=0: digits)
    calls: list[str] = []
    for name, module in STAGES.items():
        def fake(ctx, name=name):  # type: ignore[no-untyped-def]
            calls.append(name)
            if name == "amp":
                ctx.fp32_model = torch.nn.Identity()
            return Table(name, ["x"], [[1]], curves={"O0": [1.0, 0.5]} if name == "amp" else None)
        monkeypatch.setattr(importlib.import_module(module), "run", fake)
    return calls


@pytest.mark.parametrize(("kw", "message"), [
    # the amp stage run first for quant trains at O0 in fp32: O2 was dropped without a word
    ({"stages": ["quant"], "opt_levels": ("O2",)}, "--opt-level has no effect on stage(s) quant: only amp uses it; "
                                                   "add --stage amp, or leave --opt-level out"),
    ({"stages": ["engine"], "dtype": "bf16"}, "--dtype has no effect on stage(s) engine: only amp uses it"),
    ({"stages": ["transformer"], "epochs": 20},
     "--epochs has no effect on stage(s) transformer: only amp, quant, data"),
    ({"stages": ["distributed"], "batch_size": 32, "dtype": "bf16"},
     "--dtype and --batch-size have no effect on stage(s) distributed"),
    ({"stages": ["data"], "batch_size": 32, "quick": False}, "--batch-size has no effect on stage(s) data"),
])
def test_a_setting_no_chosen_stage_uses_is_refused_before_work(ran: list[str], kw: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_demo(**{"device": "cpu", "progress": False, "quick": True, **kw})
    assert ran == []


@pytest.mark.parametrize("kw", [
    {"stages": ["quant"], "opt_levels": ("O0",)},  # O0 is what the amp stage before quant trains at
    {"stages": ["sparsity"], "epochs": 1, "batch_size": 32},  # the O0 model sparsity starts from trains with them
    {"stages": ["amp"], "opt_levels": ("O2",), "dtype": "bf16"},
    {"stages": ["data"], "epochs": 1, "batch_size": 32},  # --quick: the data stage trains the digits CNN with both
    {"epochs": 1, "dtype": "bf16"},  # every stage
])
def test_a_setting_a_chosen_stage_uses_runs(ran: list[str], kw: dict) -> None:
    run_demo(**{"device": "cpu", "progress": False, "quick": True, **kw})
    assert ran


def test_the_cli_refuses_an_unused_flag_in_one_line(ran: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from overdrive.cli.main import main

    assert main(["demo", "--quick", "--no-progress", "--stage", "quant", "--opt-level", "O2"]) == 2
    err = capsys.readouterr().err
    assert "--opt-level has no effect on stage(s) quant" in err and "Traceback" not in err
    assert ran == []


@pytest.mark.parametrize("json_in", ["same", "same/", "report.json", "report.md", "loss_amp.png"])
def test_json_that_the_report_folder_would_take_is_refused_before_work(ran: list[str], tmp_path: Path, json_in: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--json X --report X` (a new path) wrote the JSON to X, then the report failed on FileExistsError after every
    stage had run; `--json DIR/report.json --report DIR` had the JSON overwritten by the report's own."""
    pytest.importorskip("matplotlib")
    from overdrive.cli.main import main

    rep = tmp_path / "same"
    if json_in in ("same", "same/"):
        target = str(tmp_path / json_in)
    else:
        rep.mkdir()
        target = str(rep / json_in)
    code = main(["demo", "--quick", "--no-progress", "--stage", "data", "--json", target, "--report", str(rep)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--report" in err and f"give --json {'another path' if json_in.startswith('same') else 'a path outside'}" \
        in err
    assert ran == []
    assert not rep.exists() or list(rep.iterdir()) == []


def test_json_beside_the_report_folder_is_written(ran: list[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from overdrive.cli.main import main

    rep = tmp_path / "rep"
    assert main(["demo", "--quick", "--no-progress", "--stage", "data", "--json", str(tmp_path / "rep.json"),
                 "--report", str(rep)]) == 0
    assert json.loads((tmp_path / "rep.json").read_text())["tables"] and (rep / "report.md").is_file()


def test_report_command_reproduces_the_run(ran: list[str], tmp_path: Path) -> None:
    """The report's command was `"overdrive " + " ".join(sys.argv[1:])`: from main([...]) in a script or notebook
    it named that process's arguments (pytest's here), and a folder with a space came back as two arguments."""
    pytest.importorskip("matplotlib")
    from overdrive.cli.demo import command
    from overdrive.cli.main import main

    rep, out = tmp_path / "my report", tmp_path / "r s.json"
    args = ["demo", "--quick", "--no-progress", "--stage", "sparsity", "--stage", "data", "--epochs", "1",
            "--seed", "3", "--json", str(out), "--report", str(rep)]
    assert main(args) == 0
    meta = json.loads((rep / "report.json").read_text())["meta"]
    for cmd in (json.loads(out.read_text())["command"], meta["command"]):
        words = shlex.split(cmd)
        assert words[:2] == ["overdrive", "demo"]
        again = command.make_context("demo", words[2:]).params
        assert again == command.make_context("demo", args[1:]).params


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 2**70])
def test_a_seed_torch_cannot_take_is_refused_before_work(ran: list[str], seed: int,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--seed 2**70` was accepted, then failed on "ValueError: Overflow when unpacking long long" with exit 1."""
    from overdrive.cli.main import main

    with pytest.raises(UsageError, match=f"--seed {seed} does not fit torch's 64-bit generator"):
        run_demo(device="cpu", stages=["sparsity"], seed=seed, quick=True, progress=False)
    assert main(["demo", "--quick", "--no-progress", "--stage", "sparsity", "--seed", str(seed)]) == 2
    assert "use a seed from" in capsys.readouterr().err and ran == []


def test_one_epoch_amp_note_says_its_rate_includes_the_warm_up(digits) -> None:  # type: ignore[no-untyped-def]
    """With --epochs 1 the only epoch is the warm-up one, and samples/s is measured over it; the note said that
    samples/s excluded it."""
    from overdrive.demo import amp_stage
    from overdrive.demo.context import DemoContext

    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=digits, epochs=1, progress=False,
                      opt_levels=("O0",))
    notes = " ".join(amp_stage.run(ctx).notes)
    assert "excludes the first" not in notes and "samples/s is the one epoch's, warm-up (and compile) included" in notes
    assert "1 epoch(s) of 1438 images" in notes
