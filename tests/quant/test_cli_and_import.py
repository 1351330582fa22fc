from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from overdrive.cli.quantize import command


def test_cli_quantize_factory_and_export(tmp_path) -> None:
    pytest.importorskip("onnx")
    calib = tmp_path / "calib.pt"
    torch.save(torch.randn(64, 1, 8, 8), calib)
    out_json, onnx_path = tmp_path / "r.json", tmp_path / "m.onnx"
    res = CliRunner().invoke(command, ["--model", "overdrive.demo.models:DigitsCNN", "--calib-data", str(calib),
                                       "--method", "percentile", "--calib-batches", "2", "--export", str(onnx_path),
                                       "--json", str(out_json)])
    assert res.exit_code == 0, res.output
    data = json.loads(out_json.read_text())
    assert data["config"]["method"] == "percentile" and len(data["layers"]) == 10
    assert data["onnx"]["ops"]["QuantizeLinear"] == 18 and onnx_path.exists()


@pytest.mark.parametrize("args, fragment", [
    (["--model", "nope.mod:make"], "cannot import"),
    (["--model", "overdrive.demo.models:DigitsCNN", "--calib-data", "missing.pt"], "calib-data"),
])
def test_cli_bad_input(args: list[str], fragment: str) -> None:
    res = CliRunner().invoke(command, args)
    assert res.exit_code != 0 and fragment in str(res.exception or res.output)
