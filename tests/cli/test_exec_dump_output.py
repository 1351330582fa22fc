"""``overdrive exec --dumpOutput`` (trtexec's flag): the outputs of one inference printed after the summary, each
output's name and dimensions then its values, checked against numpy on the same inputs (fp32 MatMul, tolerance
1e-5 on the printed 6 significant digits; int64 exact). A hand-made ONNX model on the onnxruntime backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from overdrive.cli.main import main

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto as T, helper as h, numpy_helper  # noqa: E402

W = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """'x' (B, 4) float -> 'y' = x @ W; 'ids' (B, 2) int64 -> 'ids_plus' = ids + 1."""
    d = tmp_path_factory.mktemp("dump")
    g = h.make_graph([h.make_node("MatMul", ["x", "W"], ["y"]), h.make_node("Add", ["ids", "one"], ["ids_plus"])],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, ["B", 4]), h.make_tensor_value_info("ids", T.INT64, ["B", 2])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["B", 3]), h.make_tensor_value_info("ids_plus", T.INT64, ["B", 2])],
                     [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.array(1, np.int64), "one")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    (d / "m.onnx").write_bytes(m.SerializeToString())
    assert main(["build", "--onnx", str(d / "m.onnx"), "--saveEngine", str(d / "m.engine"), "--backend", "onnxruntime",
                 "--minShapes", "x:1x4,ids:1x2", "--optShapes", "x:2x4,ids:2x2", "--maxShapes", "x:8x4,ids:8x2"]) == 0
    return d / "m.engine"


def _exec(engine: Path, *args: str) -> int:
    return main(["exec", "--loadEngine", str(engine), "--iterations", "1", "--duration", "0", "--warmUp", "0", *args])


def test_dump_output_prints_each_output(engine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    ids = np.array([[5, -2], [0, 7], [9, 9]], np.int64)
    np.savez(tmp_path / "in.npz", x=x, ids=ids)
    assert _exec(engine, "--loadInputs", str(tmp_path / "in.npz"), "--dumpOutput") == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("[I] Output Tensors:")
    assert out[start + 1] == "[I] y: (3x3)" and out[start + 3] == "[I] ids_plus: (3x2)"
    y = np.array([float(v) for v in out[start + 2].removeprefix("[I] ").split()], np.float32).reshape(3, 3)
    np.testing.assert_allclose(y, x @ W, rtol=1e-5, atol=1e-5)
    assert [int(v) for v in out[start + 4].removeprefix("[I] ").split()] == (ids + 1).reshape(-1).tolist()
    assert not list(tmp_path.glob("*.json"))  # no --exportOutput: nothing left behind


def test_dump_output_with_json_to_stdout_keeps_stdout_json(engine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert _exec(engine, "--dumpOutput", "--json", "-") == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["iterations"] >= 1
    assert "[I] Output Tensors:" in cap.err
