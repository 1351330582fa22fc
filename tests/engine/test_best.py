"""``--best``: build every candidate precision, time each, keep the fastest (trtexec's --best enables every
precision and keeps the fastest tactic). Outputs are checked against the fp32 model at the tolerance of the
precision that was kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine import Builder, Engine, ShapeProfile

PROFILE = [ShapeProfile.fixed("x", (16, 1, 8, 8))]
TOL = {"fp32": 1e-4, "int8": 0.15}  # of the logit scale


def test_best_times_every_candidate_and_keeps_the_fastest(digits: torch.nn.Module) -> None:
    x = torch.randn(16, 1, 8, 8)
    eng = Builder(precision="best", device="cpu", profiles=PROFILE).build(digits, (x,), input_names=["x"], calib=[(x,)])
    best = eng.header["best"]
    times = best["candidates_ms"]
    assert set(times) == {"fp32", "int8"} and all(isinstance(v, float) and v > 0 for v in times.values())
    assert best["chosen"] == min(times, key=times.get) == eng.header["precision"] and best["not_tried"] == {}
    with torch.no_grad():
        ref = digits(x)
    assert (eng(x) - ref).abs().max().item() <= TOL[eng.header["precision"]] * max(ref.abs().max().item(), 1.0)


def test_best_without_calibration_tries_no_int8(tmp_path: Path, digits: torch.nn.Module) -> None:
    eng = Builder(precision="best", device="cpu", profiles=PROFILE).build(digits, input_names=["x"])
    assert list(eng.header["best"]["candidates_ms"]) == ["fp32"]
    assert "calib" in eng.header["best"]["not_tried"]["int8"]
    eng.save(tmp_path / "b.engine")
    assert Engine.load(tmp_path / "b.engine", precision="best").header["precision"] == "fp32"
    Builder(precision="fp32", device="cpu", profiles=PROFILE).build(digits).save(tmp_path / "p.engine")
    with pytest.raises(UsageError, match="not with --best"):
        Engine.load(tmp_path / "p.engine", precision="best")


def test_best_records_a_candidate_that_cannot_be_built() -> None:
    """A float ONNX model with nothing to quantize (one Relu): its int8 candidate fails; --best says why and keeps
    fp32."""
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    relu = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = torch.randn(4, 8)
    eng = Builder(precision="best", device="cpu").build(relu, (x,), calib=[(x,)])
    assert eng.header["precision"] == "fp32"
    assert eng.header["best"]["candidates_ms"]["int8"].startswith("not built: ")
    assert "no Conv, ConvTranspose, Gemm or weight MatMul" in eng.header["best"]["candidates_ms"]["int8"]


def test_best_calibrates_a_float_onnx_model(digits_onnx: bytes) -> None:
    """With --calib, a float ONNX model's int8 candidate is calibrated (ONNX Runtime quantize_static) and timed."""
    x = torch.randn(4, 1, 8, 8)
    eng = Builder(precision="best", device="cpu").build(digits_onnx, (x,), calib=[(x,)])
    assert isinstance(eng.header["best"]["candidates_ms"]["int8"], float)


def test_cli_best_prints_the_candidates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.engine"
    assert main(["build", "--model", "overdrive.recipes.models:DigitsCNN", "--shapes", "x:8x1x8x8", "--best",
                 "--saveEngine", str(out)]) == 0
    text = capsys.readouterr().out
    assert "--best timed fp32" in text and "kept fp32" in text and "int8 not tried: no calibration data" in text


def test_best_rejects_an_int8_candidate_whose_layers_all_run_float(monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 candidate whose build kept every layer float (here its whole engine timed slower than its float twin,
    forced) computes what the float candidate computes (the same weights, or int8-rounded ones): --best rejects it and
    says why, rather than let it win on timing noise."""
    import overdrive.engine.backends.whole_engine as we
    import overdrive.engine.layer_choice as lc
    from overdrive.engine import BuildConfig

    real = lc.keep_float_where_faster
    monkeypatch.setattr(lc, "keep_float_where_faster",
                        lambda *a, **kw: real(*a, **{**kw, "margin": 1e9, "conv_margin": 1e9}))  # layers stay int8
    monkeypatch.setattr(we, "whole_engine_timed", lambda cfg, device: True)
    monkeypatch.setattr(we, "paired_ms", lambda a, b, device, rounds=5: (2.0, 1.0))  # the float twin wins
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16)).eval()
    x = torch.randn(16, 1, 8, 8)
    cfg = BuildConfig(precision="best", device="cpu", backend="inductor", aot=False, profiles=tuple(PROFILE))
    eng = Builder(cfg).build(model, (x,), input_names=["x"], calib=[(x,)])
    best = eng.header["best"]
    assert best["chosen"] == eng.header["precision"] == "fp32"
    why = best["rejected"]["int8"]
    assert why.startswith("every int8 layer runs in float (int8 0.50x float32 as a whole engine") and \
        "no faster than the float candidate" in why, why
    assert best["candidates_ms"]["int8"] == f"rejected: {why}"
