"""``overdrive compare --shapes / --inputs``: engine vs engine at another batch, ONNX vs ONNX, a corrupt
ONNX file as one line naming it (it was ORT's raw ``[ONNXRuntimeError] : 7 : INVALID_PROTOBUF``)."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive.cli.main import main


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    path = tmp_path_factory.mktemp("cmp") / "lin.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(2, 4),), str(path), input_names=["input"], output_names=["out"],
                          dynamic_axes={"input": {0: "b"}}, dynamo=False)
    return path


def test_corrupt_onnx_is_one_line_naming_the_file(tmp_path: Path, onnx_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    code, _, err = _cli("compare", str(bad), str(onnx_path))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "bad.onnx" in lines[0] and "cannot be loaded" in lines[0], err
    assert "not a valid ONNX protobuf" in lines[0] and "[ONNXRuntimeError]" not in lines[0], lines[0]


def test_a_pt_file_is_refused_in_one_line_naming_what_to_compare(tmp_path: Path, onnx_path: Path) -> None:
    whole = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(4, 3), whole)  # a pickled model: never loaded
    code, _, err = _cli("compare", str(whole), str(onnx_path))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "does not unpickle" in lines[0] and "--checkpoint" in lines[0], err


def test_onnx_vs_onnx_with_shapes(onnx_path: Path) -> None:
    code, out, _ = _cli("compare", str(onnx_path), str(onnx_path), "--shapes", "input:5x4", "--json", "-")
    r = json.loads(out)
    assert code == 0 and r["passed"] and r["outputs"][0]["shape"] == [5, 3]
    code, _, err = _cli("compare", str(onnx_path), str(onnx_path))  # a dynamic batch: the fix is named
    assert code == 2 and "--shapes input:1x4" in err
    code, _, err = _cli("compare", str(onnx_path), str(onnx_path), "--shapes", "inpt:5x4")
    assert code == 2 and "'inpt'" in err and "'input'" in err


@pytest.mark.parametrize("kind", ["pt-dict", "pt-tuple", "pt-tensor", "npz"])
def test_inputs_file(tmp_path: Path, onnx_path: Path, kind: str) -> None:
    x = torch.randn(7, 4)
    f = tmp_path / ("in.npz" if kind == "npz" else "in.pt")
    if kind == "npz":
        np.savez(f, input=x.numpy())
    else:
        torch.save({"pt-dict": {"input": x}, "pt-tuple": (x,), "pt-tensor": x}[kind], f)
    code, out, err = _cli("compare", str(onnx_path), str(onnx_path), "--inputs", str(f), "--json", "-")
    assert code == 0, err
    assert json.loads(out)["outputs"][0]["shape"] == [7, 3]


def test_inputs_file_errors(tmp_path: Path, onnx_path: Path) -> None:
    torch.save({"x": torch.randn(2, 4)}, tmp_path / "wrong.pt")
    code, _, err = _cli("compare", str(onnx_path), str(onnx_path), "--inputs", str(tmp_path / "wrong.pt"))
    assert code == 2 and "'x'" in err and "'input'" in err
    code, _, err = _cli("compare", str(onnx_path), str(onnx_path), "--inputs", str(tmp_path / "none.pt"))
    assert code == 2 and "does not exist" in err
    code, _, err = _cli("compare", str(onnx_path), str(onnx_path), "--inputs", str(tmp_path / "wrong.pt"),
                        "--shapes", "input:2x4")
    assert code == 2 and "not both" in err
    torch.save({"input": [1, 2]}, tmp_path / "obj.pt")
    code, _, err = _cli("compare", str(onnx_path), str(onnx_path), "--inputs", str(tmp_path / "obj.pt"))
    assert code == 2 and "not tensors" in err


def test_two_pytorch_models_need_shapes() -> None:
    code, _, err = _cli("compare", "overdrive.recipes.models:DigitsCNN", "overdrive.recipes.models:DigitsCNN")
    assert code == 2 and "--shapes" in err and "--inputs" in err
    code, out, _ = _cli("compare", "overdrive.recipes.models:DigitsCNN", "overdrive.recipes.models:DigitsCNN",
                        "--shapes", "x:3x1x8x8", "--json", "-")
    assert json.loads(out)["outputs"][0]["shape"] == [3, 10]


def test_engine_vs_engine_at_another_batch(tmp_path: Path, onnx_path: Path) -> None:
    eng = tmp_path / "lin.engine"
    code, _, err = _cli("build", "--onnx", str(onnx_path), "--backend", "onnxruntime", "--save-engine", str(eng),
                        "--min-shapes", "input:1x4", "--opt-shapes", "input:2x4", "--max-shapes", "input:8x4")
    assert code == 0, err
    code, out, err = _cli("compare", str(eng), str(eng), "--shapes", "input:6x4", "--json", "-")
    assert code == 0, err
    assert json.loads(out)["outputs"][0]["shape"] == [6, 3]
    code, _, err = _cli("compare", str(eng), str(onnx_path), "--shapes", "input:9x4")
    assert code == 2 and "outside the engine's profile" in err


def test_an_fp8_qdq_file_is_compared_as_written(tmp_path: Path) -> None:
    """compare's ONNX Runtime reference ran at ORT_ENABLE_ALL, where ONNX Runtime 1.32 drops a ReLU feeding an fp8
    QuantizeLinear: the fake-quant model it was exported from came out 0.55 off a 1.1 output, a false FAILED."""
    from overdrive import quant
    from overdrive.engine.compare import compare

    class TwoBranch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(8, 32), torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

        def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.relu(self.a(y)) + torch.relu(self.b(x)))

    torch.manual_seed(0)
    y, x = torch.randn(4, 8), torch.randn(4, 16)
    q = quant.quantize(TwoBranch().eval(), quant.FP8_DEFAULT, lambda m: m(y, x))
    path = tmp_path / "fp8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quant.export_onnx(q, (y, x), path, opset=19, input_names=["y", "x"])
    r = compare(q, str(path), inputs=(y, x), atol=1e-5, rtol=1e-5)
    assert r["passed"], r["outputs"]


FACTORY_PY = '''
import torch


def make():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
'''


def test_checkpoint_loads_the_trained_weights_into_a_factory_side(tmp_path: Path) -> None:
    """compare had no --checkpoint: an engine built with `build --model f.py:make --checkpoint w.pt` compared against
    f.py:make ran the factory's random weights and FAILED, with nothing saying why."""
    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    onnx = tmp_path / "trained.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(trained, (torch.randn(2, 4),), str(onnx), input_names=["input"], output_names=["out"],
                          dynamo=False)
    weights = tmp_path / "w.pt"
    torch.save(trained.state_dict(), weights)
    (tmp_path / "factory.py").write_text(FACTORY_PY)
    spec = f"{tmp_path / 'factory.py'}:make"
    code, out, err = _cli("compare", str(onnx), spec, "--checkpoint", str(weights), "--json", "-")
    r = json.loads(out)
    assert code == 0 and r["passed"] and r["outputs"][0]["max_abs"] < 1e-5, (out, err)  # fp32 ORT vs torch
    code, _, err = _cli("compare", str(onnx), spec, "--seed", "1")  # the factory's own (random) weights
    assert code == 1 and "[I] B (" in err and "ran with the weights its factory gives" in err and "--checkpoint" in err
    code, _, err = _cli("compare", str(onnx), str(onnx), "--checkpoint", str(weights))
    assert code == 2 and "neither A" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _cli("compare", str(onnx), spec, "--checkpoint", str(tmp_path / "nope.pt"))
    assert code == 2 and "'" + str(tmp_path / "nope.pt") + "' does not exist" in err, err
