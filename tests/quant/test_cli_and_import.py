from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from overdrive._utils.errors import UsageError
from overdrive.cli.quantize import command


def test_cli_quantize_factory_and_export(tmp_path) -> None:
    pytest.importorskip("onnx")
    calib = tmp_path / "calib.pt"
    torch.save(torch.randn(64, 1, 8, 8), calib)
    out_json, onnx_path = tmp_path / "r.json", tmp_path / "m.onnx"
    res = CliRunner().invoke(command, ["--model", "overdrive.recipes.models:DigitsCNN", "--calib-data", str(calib),
                                       "--method", "percentile", "--calib-batches", "2", "--export", str(onnx_path),
                                       "--json", str(out_json)])
    assert res.exit_code == 0, res.output
    data = json.loads(out_json.read_text())
    assert data["config"]["method"] == "percentile" and len(data["layers"]) == 10
    assert data["onnx"]["ops"]["QuantizeLinear"] == 18 and onnx_path.exists()


@pytest.mark.parametrize("args, fragment", [
    (["--model", "nope.mod:make"], "cannot import"),
    (["--model", "overdrive.recipes.models:DigitsCNN", "--calib-data", "missing.pt"], "calib-data"),
])
def test_cli_bad_input(args: list[str], fragment: str) -> None:
    res = CliRunner().invoke(command, args)
    assert res.exit_code != 0 and fragment in str(res.exception or res.output)


@pytest.mark.parametrize("args, fragment", [
    (["--export", "m.onnx", "--opset", "30"], "opset=30 is newer"),
    (["--export", "m.onnx", "--opset", "11"], "opset=11 is too old"),
    (["--export", "m.onnx", "--config", "fp8", "--opset", "17"], "opset >= 19"),
])
def test_cli_bad_opset_is_a_usage_error_before_calibration(tmp_path, monkeypatch, args, fragment) -> None:
    """An opset the export cannot use is refused (exit 2) before the model is loaded and calibrated
    (opset 30 used to fail after calibration inside torch.onnx, exit 1)."""
    from overdrive.cli.main import main
    from overdrive.recipes import quantize as cli_support

    def no_load(spec: str):  # noqa: ANN202
        raise AssertionError("the model was loaded before --opset was checked")

    monkeypatch.setattr(cli_support, "load_model", no_load)
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", *args]) == 2
    with pytest.raises(UsageError, match=fragment):
        cli_support.run_quantize("digits", "digits", "fp8" if "fp8" in args else "int8", "max", 99.99, 1, 8,
                                 "m.onnx", int(args[args.index("--opset") + 1]))


@pytest.mark.parametrize("data, fragment", [
    (torch.randn(0, 1, 8, 8), "no samples"),
    ([(torch.randn(8, 1, 8, 8), torch.zeros(8))], "holds 2 tensors but the model's forward takes 1"),
    ([], "empty list"),
])
def test_cli_calib_data_without_inputs(tmp_path, data, fragment) -> None:
    """Calibration files with no usable inputs are named with what is wrong (an empty tensor used to
    end in 'forward_loop never reached quantizer(s)')."""
    calib = tmp_path / "calib.pt"
    torch.save(data, calib)
    res = CliRunner().invoke(command, ["--model", "overdrive.recipes.models:DigitsCNN", "--calib-data", str(calib)])
    assert isinstance(res.exception, UsageError) and fragment in str(res.exception) and str(calib) in str(res.exception)
