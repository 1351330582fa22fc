"""trtexec command lines ported as they are: ``--exportProfile`` writes trtexec's leading ``{"count": N}`` entry,
and the flags a ported command line carries do what trtexec's do. A hand-made ONNX model on the onnxruntime
backend (no compile)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from overdrive.cli.main import main

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto as T, helper as h, numpy_helper  # noqa: E402

W = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """'x' (B, 4) -> 'y' = relu(x @ W), B dynamic."""
    d = tmp_path_factory.mktemp("port")
    g = h.make_graph([h.make_node("MatMul", ["x", "W"], ["t"]), h.make_node("Relu", ["t"], ["y"])], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, ["B", 4])], [h.make_tensor_value_info("y", T.FLOAT, ["B", 3])],
                     [numpy_helper.from_array(W, "W")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    (d / "m.onnx").write_bytes(m.SerializeToString())
    return d / "m.onnx"


@pytest.fixture(scope="module")
def engine(model: Path) -> Path:
    out = model.with_suffix(".engine")
    assert main(["build", "--onnx", str(model), "--saveEngine", str(out), "--backend", "onnxruntime",
                 "--minShapes", "x:1x4", "--optShapes", "x:2x4", "--maxShapes", "x:8x4"]) == 0
    return out


def _exec(engine: Path, *args: str) -> int:
    return main(["exec", "--loadEngine", str(engine), "--iterations", "1", "--duration", "0", "--warmUp", "0", *args])


def test_export_profile_starts_with_the_run_count(engine: Path, tmp_path: Path) -> None:
    """trtexec's profile JSON is [{"count": N}, {layer}, ...]; parsers of it read the count from the first entry."""
    out = tmp_path / "profile.json"
    assert _exec(engine, "--exportProfile", str(out), "--separateProfileRun") == 0
    rows = json.loads(out.read_text())
    assert rows[0] == {"count": 10}
    assert rows[1:] and all({"name", "timeMs", "averageMs", "percentage"} <= set(r) for r in rows[1:])
    assert abs(sum(r["percentage"] for r in rows[1:]) - 100) < 1e-6
