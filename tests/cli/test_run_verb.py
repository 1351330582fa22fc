"""``overdrive run`` (polygraphy's run: an engine built from the ONNX model against ONNX Runtime), the tolerance
flags (inf refused as NaN and negatives are), and error hints that paste back into a shell."""

from __future__ import annotations

import contextlib
import io
import shlex
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


def _onnx(path: Path, names: tuple[str, ...] = ("x",), dynamic: bool = False) -> Path:
    """A MatMul-with-weight (+ Add of the other inputs) ONNX model, nodes left unnamed as hand-built graphs have them."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    dims: list = ["N", 16] if dynamic else [2, 16]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n in names]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [dims[0], 8])
    w = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    nodes, cur = [], names[0]
    for i, n in enumerate(names[1:]):
        nodes.append(helper.make_node("Add", [cur, n], [f"s{i}"]))
        cur = f"s{i}"
    nodes.append(helper.make_node("MatMul", [cur, "w"], ["y"]))
    graph = helper.make_graph(nodes, "g", ins, [out], [helper.make_tensor("w", TensorProto.FLOAT, [16, 8], w.ravel())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_run_compares_an_engine_with_onnxruntime_and_round_trips_inputs(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    model = _onnx(tmp_path / "my model.onnx", ("in put:0", "b"), dynamic=True)
    saved = tmp_path / "in puts.npz"
    code, out, err = _cli("run", str(model), "--onnxrt", "--trt", "--atol", "1e-3",
                          "--input-shapes", "'in put:0':[3,16] b:[3,16]", "--save-inputs", str(saved))
    assert code == 0, err
    assert "PASSED" in out and "overdrive engine" in out
    with np.load(saved) as z:
        assert sorted(z.files) == ["b", "in put:0"] and z["b"].shape == (3, 16)
    code, out, err = _cli("run", str(model), "--trt", "--onnxrt", "--load-inputs", str(saved))
    assert code == 0, err
    assert "(3, 8)" in out


@pytest.mark.parametrize("args, needle", [
    (("--onnxrt",), "got --onnxrt: give both"),
    (("--trt", "--onnxrt", "--load-inputs", "in.json"), "JSON inputs are not read here"),
])
def test_run_refuses_what_it_cannot_do_in_one_line(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    model = _onnx(tmp_path / "m.onnx")
    code, _, err = _cli("run", str(model), *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_run_refuses_a_file_that_is_not_onnx(tmp_path: Path) -> None:
    code, _, err = _cli("run", str(tmp_path / "model.pt"), "--trt", "--onnxrt")
    assert code == 2 and "expected an .onnx model" in err and "overdrive compare" in err


def test_polygraphy_input_shapes_read_as_trtexec_shapes() -> None:
    from overdrive.recipes.run import polygraphy_shapes

    assert polygraphy_shapes(["x:[1,3,8,8] 'a b':[2]", "y:4x5"]) == "x:1x3x8x8,'a b':2,y:4x5"


@pytest.mark.parametrize("verb", ["compare", "run"])
@pytest.mark.parametrize("flag", ["--atol", "--rtol"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-1"])
def test_infinite_nan_and_negative_tolerances_are_refused(tmp_path: Path, verb: str, flag: str, value: str) -> None:
    model = _onnx(tmp_path / "m.onnx")
    args = [str(model), str(model)] if verb == "compare" else [str(model), "--trt", "--onnxrt"]
    code, out, err = _cli(verb, *args, f"{flag}={value}")
    assert code == 2 and not out
    assert f"'{value}': expected a finite tolerance >= 0" in err and flag in err


def test_missing_shape_hint_pastes_back_for_names_with_spaces_and_colons(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    model = _onnx(tmp_path / "m.onnx", ("in put:0", "b:1"), dynamic=True)
    code, _, err = _cli("build", "--onnx", str(model), "--save-engine", str(tmp_path / "m.engine"))
    assert code == 2
    hint = err.split("--shapes ", 1)[1].split(" (or", 1)[0]
    from overdrive.engine.config import parse_shapes

    assert parse_shapes(shlex.split(hint)[0]) == {"in put:0": (1, 16), "b:1": (1, 16)}


class _OrtBackend:
    NAME = "onnxruntime"

    @staticmethod
    def int8_dynamic_unavailable(src: object, device: torch.device) -> None:
        return None


def test_int8_auto_reason_is_true_to_a_matmul_only_model(tmp_path: Path) -> None:
    from overdrive.engine.int8 import resolve
    from overdrive.engine.sources import ModelSource, from_module, from_onnx

    src = from_onnx(str(_onnx(tmp_path / "mm.onnx")))  # unnamed MatMul node: a GEMM-only model
    mode, why = resolve(None, _OrtBackend(), torch.device("cpu"), src, None)
    assert mode == "dynamic" and "convolution" not in why

    class Bare(torch.nn.Module):  # a parameter matmul, no Linear and no convolution
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    mode, why = resolve(None, _OrtBackend(), torch.device("cpu"), from_module(Bare()), None)
    assert mode == "static" and "convolution" not in why and "no Linear layers" in why
    assert isinstance(src, ModelSource)


@pytest.mark.parametrize("verb", ["build", "run"])
def test_an_empty_onnx_file_is_named_as_such(tmp_path: Path, verb: str) -> None:
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    args = (["--onnx", str(empty), "--save-engine", str(tmp_path / "e.engine")] if verb == "build"
            else [str(empty), "--trt", "--onnxrt"])
    code, _, err = _cli(verb, *args)
    assert code == 2 and "declares no inputs (an empty or truncated file?)" in err


@pytest.mark.parametrize("saved, needle", [
    ({"inp": torch.zeros(2, 16)}, "holds inp (2x16), but the model takes x (Nx16): no input named 'inp'"),
    ({"X": torch.zeros(2, 16)}, "no input named 'X' (did you mean 'x'?)"),
    ({"x": torch.zeros(2, 15)}, "holds x (2x15), but the model takes x (Nx16): 'x' dim 1 is 15, which the model fixes "
                                "at 16"),
    ({"x": torch.zeros(16)}, "'x' has 1 dims, the model's 2"),
    ([torch.zeros(2, 16), torch.zeros(2, 16)], "2 tensor(s) for 1 input(s)"),
    ({"0.weight": torch.zeros(8, 16), "0.bias": torch.zeros(8)}, "holds weights (a state_dict: '0.weight', '0.bias'), "
                                                                 "not inputs; the model takes x (Nx16)"),
])
def test_load_inputs_that_do_not_fit_name_the_file_its_arrays_and_the_model_inputs(
        tmp_path: Path, saved: object, needle: str) -> None:
    """A --load-inputs file of other names or shapes reached the profile check ("shape profiles must name every
    model input ['x']: missing [], unknown ['inp']", "the profile asks for 15..15"), which named neither the file
    nor what it holds; a state_dict there read as inputs named '0.weight'."""
    model = _onnx(tmp_path / "m.onnx", dynamic=True)
    torch.save(saved, tmp_path / "in.pt")
    code, _, err = _cli("run", str(model), "--trt", "--onnxrt", "--load-inputs", str(tmp_path / "in.pt"))
    err = " ".join(err.split())
    assert code == 2 and f"--load-inputs {tmp_path / 'in.pt'}" in err and needle in err, err
    code, _, err = _cli("run", str(model), "--trt", "--onnxrt", "--load-inputs", str(tmp_path / "none.pt"))
    assert code == 2 and "--load-inputs" in err and "does not exist" in err and "--inputs " not in err, err
