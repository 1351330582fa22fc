"""``overdrive exec --loadInputs / --exportOutput`` (trtexec's flags): raw ``name:file.bin`` inputs in each
binding's dtype (names holding ':'), or one .pt / .npz file; the outputs of one inference as JSON, checked against
numpy on the same inputs (fp32 MatMul, tolerance 1e-6; int64 exact). Bad specs are one line, before the load.
A hand-made ONNX model on the onnxruntime backend: no compile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive.cli.main import main

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto as T, helper as h, numpy_helper  # noqa: E402

W = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
PROFILE = "input:0:{b}x4,ids:{b}x5"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """'input:0' (B, 4) float -> 'y' = input @ W; 'ids' (B, 5) int64 -> 'ids_plus' = ids + 1."""
    d = tmp_path_factory.mktemp("io")
    g = h.make_graph([h.make_node("MatMul", ["input:0", "W"], ["y"]), h.make_node("Add", ["ids", "one"], ["ids_plus"])],
                     "g", [h.make_tensor_value_info("input:0", T.FLOAT, ["B", 4]),
                           h.make_tensor_value_info("ids", T.INT64, ["B", 5])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["B", 3]), h.make_tensor_value_info("ids_plus", T.INT64, ["B", 5])],
                     [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.array(1, np.int64), "one")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    (d / "m.onnx").write_bytes(m.SerializeToString())
    assert main(["build", "--onnx", str(d / "m.onnx"), "--saveEngine", str(d / "m.engine"), "--backend", "onnxruntime",
                 "--minShapes", PROFILE.format(b=1), "--optShapes", PROFILE.format(b=2), "--maxShapes", PROFILE.format(b=8)]) == 0
    return d / "m.engine"


def _inputs(b: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(b)
    return g.standard_normal((b, 4)).astype(np.float32), g.integers(0, 100, (b, 5)).astype(np.int64)


def _exec(engine: Path, *args: str) -> int:
    return main(["exec", "--loadEngine", str(engine), "--iterations", "1", "--duration", "0", "--warmUp", "0", *args])


def _check(out: Path, x: np.ndarray, ids: np.ndarray) -> None:
    rows = json.loads(out.read_text())
    assert [(r["name"], r["dimensions"], r["dtype"]) for r in rows] == [
        ("y", f"{len(x)}x3", "float32"), ("ids_plus", f"{len(x)}x5", "int64")]
    np.testing.assert_allclose(np.array(rows[0]["values"], np.float32).reshape(-1, 3), x @ W, atol=1e-6, rtol=1e-6)
    assert rows[1]["values"] == (ids + 1).reshape(-1).tolist()


def test_raw_inputs_at_given_shapes_and_exported_outputs(engine: Path, tmp_path: Path) -> None:
    """trtexec's --loadInputs='input:0':x.bin at --shapes batch 3 (not the opt batch 2): the flags did not exist."""
    x, ids = _inputs(3)
    x.tofile(tmp_path / "x.bin")
    ids.tofile(tmp_path / "ids.bin")
    out = tmp_path / "out.json"
    assert _exec(engine, "--shapes", PROFILE.format(b=3), "--loadInputs",
                 f"'input:0':{tmp_path / 'x.bin'},ids:{tmp_path / 'ids.bin'}", "--exportOutput", str(out)) == 0
    _check(out, x, ids)


@pytest.mark.parametrize("kind", ["pt-dict", "npz"])
def test_one_file_of_inputs(engine: Path, tmp_path: Path, kind: str) -> None:
    x, ids = _inputs(2)
    if kind == "npz":
        path = tmp_path / "in.npz"
        np.savez(path, **{"input:0": x, "ids": ids})
    else:
        path = tmp_path / "in.pt"
        torch.save({"ids": torch.from_numpy(ids), "input:0": torch.from_numpy(x)}, path)
    out = tmp_path / "out.json"
    assert _exec(engine, "--load-inputs", str(path), "--export-output", str(out)) == 0
    _check(out, x, ids)


def test_bad_specs_are_one_line(engine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x, ids = _inputs(2)
    x.tofile(tmp_path / "x.bin")
    ids.tofile(tmp_path / "ids.bin")
    cases = {
        f"input:0:{tmp_path / 'x.bin'},ids:{tmp_path / 'nope.bin'}": "no such file",
        f"input:0:{tmp_path / 'x.bin'}": "the engine takes ['input:0', 'ids']",
        f"input:0:{tmp_path / 'ids.bin'},ids:{tmp_path / 'ids.bin'}": "holds 80 bytes; input 'input:0' at 2x4 float32 needs 32",
        f"zz:{tmp_path / 'x.bin'},ids:{tmp_path / 'ids.bin'}": "names no input of this engine",
        str(tmp_path / "missing.pt"): "does not exist",
    }
    for spec, msg in cases.items():
        assert _exec(engine, "--loadInputs", spec) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and msg in " ".join(err.split()) and "Traceback" not in err, (spec, err)


def test_repeated_shape_flags_add_up(engine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--shapes 'input:0':3x4 --shapes ids:3x5 kept only the last flag: build said 'missing input:0', exec ran the
    first input at its opt shape silently, and compare did the same."""
    onnx_path = engine.parent / "m.onnx"
    out = tmp_path / "r.engine"
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(out), "--backend", "onnxruntime",
                 "--shapes", "input:0:3x4", "--shapes", "ids:3x5"]) == 0
    capsys.readouterr()
    assert main(["exec", "--loadEngine", str(out), "--shapes", "input:0:3x4", "--shapes", "ids:3x5", "--iterations", "1",
                 "--duration", "0", "--warmUp", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch"] == 3
    assert _exec(engine, "--shapes", "input:0:1x4", "--shapes", "ids:9x5") == 2  # the second flag counts: past max 8
    assert "ids" in capsys.readouterr().err
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(out), "--minShapes", "input:0:1x4",
                 "--minShapes", "ids:1x5", "--maxShapes", "input:0:4x4,ids:4x5", "--maxShapes", "ids:4x5"]) == 2
    assert "gives input 'ids' twice" in capsys.readouterr().err


def test_shapes_for_some_dynamic_inputs_only_is_one_line(engine: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``exec --shapes ids:4x5`` on an engine with two dynamic inputs ran 'input:0' at its opt batch (2) beside ids at
    batch 4; a token model then failed deep in the engine with a broadcast error naming neither. Now: one line
    naming the input left out, for generated and for raw-file inputs; every input given still runs."""
    assert _exec(engine, "--shapes", "ids:4x5") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --shapes gives ids but not 'input:0'") and "dynamic" in err and len(err.splitlines()) == 1
    x, ids = _inputs(4)
    x.tofile(tmp_path / "x.bin")
    ids.tofile(tmp_path / "ids.bin")
    spec = f"input:0:{tmp_path / 'x.bin'},ids:{tmp_path / 'ids.bin'}"
    assert _exec(engine, "--loadInputs", spec, "--shapes", "ids:4x5") == 2
    assert "but not 'input:0'" in capsys.readouterr().err
    assert _exec(engine, "--shapes", "input:0:4x4,ids:4x5") == 0


def test_a_file_of_inputs_and_other_shapes_are_refused(engine: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # the .pt's tensors (batch 4) ran and --shapes (batch 2) was ignored, with samples/s at the file's batch
    x, ids = _inputs(4)
    path = tmp_path / "in.pt"
    torch.save({"ids": torch.from_numpy(ids), "input:0": torch.from_numpy(x)}, path)
    assert _exec(engine, "--load-inputs", str(path), "--shapes", PROFILE.format(b=2)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--load-inputs" in err and "--shapes disagree (input:0: file 4x4, --shapes 2x4" in err, err
    out = tmp_path / "out.json"  # the same shapes as the file: fine
    assert _exec(engine, "--load-inputs", str(path), "--shapes", PROFILE.format(b=4), "--export-output", str(out)) == 0
    _check(out, x, ids)
