"""A trtexec line pasted whole: its flags with no meaning here (--workspace, --memPoolSize, --skipInference,
--explicitBatch on build; --avgRuns, --separateProfileRun on exec) were "No such option" errors. They are
accepted, each with one line saying why it has no effect, and the command does what it does without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overdrive.cli.main import main


def test_trtexec_noop_flags_are_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxruntime")
    onnx_path = tmp_path / "lin.onnx"
    torch.onnx.export(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),), str(onnx_path), input_names=["input"],
                      dynamo=False)
    eng = tmp_path / "lin.engine"
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(eng), "--shapes", "input:2x4",
                 "--workspace=4096", "--memPoolSize=workspace:2048", "--skipInference", "--explicitBatch"]) == 0
    err = capsys.readouterr().err
    for flag in ("--workspace", "--memPoolSize", "--skipInference", "--explicitBatch"):
        assert f"[I] {flag} has no effect here:" in err
    assert eng.exists()
    assert main(["exec", "--loadEngine", str(eng), "--avgRuns=10", "--separateProfileRun", "--duration", "0.05"]) == 0
    captured = capsys.readouterr()
    assert "[I] --avgRuns has no effect here:" in captured.err and "Throughput:" in captured.out


def test_calib_on_a_float_build_says_it_is_unused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--calib`` on an fp32/fp16 build was ignored without a word (the user may have meant --int8); now one line
    before the build says so. The build line reads a small engine's size in kB, not "0.00 MB"."""
    pytest.importorskip("onnxruntime")
    onnx_path = tmp_path / "lin.onnx"
    torch.onnx.export(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),), str(onnx_path), input_names=["input"],
                      dynamo=False)
    torch.save(torch.randn(8, 4), tmp_path / "calib.pt")
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "e.engine"), "--shapes", "input:2x4",
                 "--calib", str(tmp_path / "calib.pt")]) == 0
    captured = capsys.readouterr()
    assert "[I] --calib has no effect here: only int8/fp8 builds calibrate, and this one is fp32" in captured.err
    assert " kB in " in captured.out and "0.00 MB" not in captured.out
