from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from overdrive.cli.quantize import command


def test_import_overdrive_quant_is_lean() -> None:
    code = ("import sys, overdrive; from overdrive import quant; "
            "bad = [m for m in ('onnx', 'onnxruntime', 'torchvision', 'transformers', 'matplotlib', 'tensorrt') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


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
