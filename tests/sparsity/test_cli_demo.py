"""`overdrive sparsify` end to end, its errors, and the demo stage registration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from overdrive.cli.main import main
from overdrive.recipes.models import DigitsCNN
from overdrive.sparsity import load_compressed
from overdrive.recipes.sparsify import build_model


def test_sparsify_cli_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = DigitsCNN()
    torch.save(model.state_dict(), tmp_path / "digits.pt")
    out = tmp_path / "digits.sparse24.pt"
    code = main(["sparsify", "--model", "digits", "--checkpoint", str(tmp_path / "digits.pt"), "--out", str(out),
                 "--input-shape", "1,1,8,8", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["report"]["flop_fraction_pruned"] > 0.3
    assert {s["name"] for s in data["report"]["skipped"]} == {"stem.0.weight", "fc2.weight"}
    assert data["storage"]["compressed_weight_bytes"] < 0.55 * data["storage"]["dense_weight_bytes"]
    # the file loads back into a fresh model and computes the pruned model's function
    fresh = DigitsCNN().eval()
    load_compressed(fresh, out)
    ref = DigitsCNN()
    ref.load_state_dict(torch.load(tmp_path / "digits.pt"))
    x = torch.randn(4, 1, 8, 8)
    assert fresh(x).shape == (4, 10)
    kept = fresh.block1.conv1[0].weight
    assert torch.equal(kept[kept != 0], ref.block1.conv1[0].weight[kept != 0])


def test_sparsify_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sparsify", "--model", "nope", "--out", str(tmp_path / "o.pt")]) == 2
    assert "must be 'package.module:factory'" in capsys.readouterr().err
    assert main(["sparsify", "--model", "digits", "--checkpoint", str(tmp_path / "missing.pt"),
                 "--out", str(tmp_path / "o.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    f = tmp_path / "tiny.py"
    f.write_text("import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(6, 3))\n")
    assert main(["sparsify", "--model", f"{f}:make", "--allow-untrained", "--out", str(tmp_path / "o.pt")]) == 2
    assert "no prunable layer" in capsys.readouterr().err


def test_demo_stage_registered_and_models_build() -> None:
    from overdrive.demo import STAGES

    assert STAGES["sparsity"] == "overdrive.demo.sparsity_stage"
    assert type(build_model("docstrings")).__name__ == "ByteTransformer"


@pytest.mark.slow
def test_demo_stage_runs_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.demo import sparsity_stage
    from overdrive.demo.context import DemoContext
    from overdrive.recipes.data import load_digits

    monkeypatch.setattr(sparsity_stage, "FINETUNE_EPOCHS", 1)
    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=load_digits(), progress=False)
    ctx.fp32_model = DigitsCNN().eval()
    ctx.fp32_accuracy = 0.1
    table = sparsity_stage.run(ctx)
    assert [r[0] for r in table.rows] == ["dense (O0)", "2:4 pruned, no fine-tune", "2:4 + fine-tune (1 epochs)",
                                          "2:4 + fine-tune + int8 PTQ (fake-quant)"]
    assert 0.0 <= table.rows[3][1] <= 1.0
    assert table.rows[1][4] < 0.55 * table.rows[0][4]
    assert 0.0 <= table.rows[2][1] <= 1.0


def test_sparsify_cli_takes_a_pruned_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A state_dict saved from a pruned, fine-tuned model carries its mask buffers; it compresses
    to exactly its own weights."""
    from overdrive.sparsity import sparsify

    torch.manual_seed(0)
    model = DigitsCNN()
    sparsify(model)
    torch.save(model.state_dict(), tmp_path / "pruned.pt")
    out = tmp_path / "o.pt"
    assert main(["sparsify", "--model", "digits", "--checkpoint", str(tmp_path / "pruned.pt"), "--out", str(out),
                 "--json"]) == 0, capsys.readouterr().err
    fresh = DigitsCNN()
    load_compressed(fresh, out)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("args, message", [
    (["--input-shape", "0,1,8,8"], "--input-shape 0,1,8,8 must be positive integers"),
    (["--input-shape", "-1,1,8,8"], "--input-shape -1,1,8,8 must be positive integers"),
    (["--input-shape", "1,3,8,8"], "--input-shape 1,3,8,8 does not fit DigitsCNN"),
    (["--exclude", "fc3"], "--exclude 'fc3' is not a module of DigitsCNN"),
    (["--out-dir"], "is a directory"),
], ids=["zero", "negative", "wrong-channels", "unknown-exclude", "out-dir"])
def test_sparsify_cli_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                          message: str) -> None:
    out = str(tmp_path / "o.pt")
    if args == ["--out-dir"]:
        args, out = [], str(tmp_path)
    assert main(["sparsify", "--model", "digits", "--allow-untrained", "--out", out, *args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err


def test_sparsify_refuses_untrained_weights_without_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `sparsify --model digits` pruned the random initial weights silently
    out = tmp_path / "o.pt"
    assert main(["sparsify", "--model", "digits", "--out", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "untrained" in err and "--checkpoint FILE" in err and "--allow-untrained" in err and not out.exists()
    assert main(["sparsify", "--model", "digits", "--allow-untrained", "--out", str(out), "--input-shape", "1,1,8,8"]) == 0
    assert out.is_file()
