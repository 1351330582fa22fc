"""Scripts written around trtexec and polygraphy read overdrive's files and text as theirs.

--exportTimes rows carry trtexec's keys (``startEnqMs`` ... ``endD2hMs``, ``endToEndMs``: what TensorRT's
tracer-style scripts read; only interval keys were written). compare reports outputs of different shapes as a
mismatch (FAILED, exit 1, as polygraphy) instead of a usage error (exit 2), prints polygraphy's verdict lines
(``PASSED | All outputs matched | Outputs: [...]`` / ``FAILED | Mismatched outputs: [...]``), and gives each
output's minimum required atol. Tiny hand-made ONNX models on the onnxruntime backend; no timing is asserted.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from overdrive.cli.main import main
from overdrive.engine import compare

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto as T, helper as h  # noqa: E402

TRTEXEC_TIMES_KEYS = ("startEnqMs", "endEnqMs", "startH2dMs", "endH2dMs", "startComputeMs", "endComputeMs",
                      "startD2hMs", "endD2hMs", "h2dMs", "computeMs", "d2hMs", "latencyMs", "endToEndMs")


def _onnx(path: Path, op: str, shape: list[int], out_shape: list[int] | None = None, **attrs: object) -> Path:
    nodes = [h.make_node(op, ["x"], ["y"], **attrs)]
    m = h.make_model(h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, shape)],
                                  [h.make_tensor_value_info("y", T.FLOAT, out_shape or shape)]),
                     opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return path


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_export_times_rows_carry_trtexecs_keys(tmp_path: Path) -> None:
    src = _onnx(tmp_path / "relu.onnx", "Relu", [2, 3])
    eng = tmp_path / "relu.engine"
    assert _cli("build", "--onnx", str(src), "--save-engine", str(eng))[0] == 0
    times = tmp_path / "times.json"
    code, _, err = _cli("exec", "--loadEngine", str(eng), "--iterations=4", "--duration=0", "--warmUp=0",
                        f"--exportTimes={times}")
    assert code == 0, err
    rows = json.loads(times.read_text())
    assert len(rows) == 4
    for r in rows:
        assert set(TRTEXEC_TIMES_KEYS) <= set(r), sorted(set(TRTEXEC_TIMES_KEYS) - set(r))
        # the stage marks are ordered in time and agree with the intervals (float rounding aside)
        marks = [r[k] for k in ("startH2dMs", "endH2dMs", "startComputeMs", "endComputeMs", "startD2hMs", "endD2hMs")]
        assert marks == sorted(marks) and r["startEnqMs"] <= r["endEnqMs"]
        assert r["endComputeMs"] - r["startComputeMs"] == pytest.approx(r["computeMs"], abs=1e-6)
        assert r["endToEndMs"] == pytest.approx(r["endD2hMs"] - r["startH2dMs"], abs=1e-9)
    assert [r["startComputeMs"] for r in rows] == sorted(r["startComputeMs"] for r in rows)


def test_compare_reports_polygraphy_verdict_lines_and_min_atol(tmp_path: Path) -> None:
    relu = _onnx(tmp_path / "relu.onnx", "Relu", [2, 3])
    ident = _onnx(tmp_path / "id.onnx", "Identity", [2, 3])
    code, out, _ = _cli("compare", str(relu), str(relu))
    assert code == 0 and "[I] PASSED | All outputs matched | Outputs: ['y']" in out, out
    code, out, _ = _cli("compare", str(relu), str(ident), "--atol", "1e-3", "--rtol", "0")
    assert code == 1 and "[E] FAILED | Mismatched outputs: ['y']" in out, out
    r = compare(str(relu), str(ident), inputs=(torch.tensor([[-2.0, 1, 0], [-0.5, 3, 4]]),), atol=1e-3, rtol=0.0)
    assert r["mismatched_outputs"] == ["y"] and not r["passed"]
    # relu(x) vs x differs by 2 at most: an atol of 2 is the least that passes at rtol 0
    assert r["outputs"][0]["min_atol"] == pytest.approx(2.0)
    assert compare(str(relu), str(ident), inputs=(torch.tensor([[-2.0, 1, 0], [-0.5, 3, 4]]),), atol=2.0,
                   rtol=0.0)["passed"]


def test_outputs_of_different_shapes_are_a_mismatch_not_a_usage_error(tmp_path: Path) -> None:
    a = _onnx(tmp_path / "a.onnx", "Identity", [2, 3])
    b = _onnx(tmp_path / "b.onnx", "Flatten", [2, 3], [6, 1], axis=2)
    code, out, err = _cli("compare", str(a), str(b), "--json", str(tmp_path / "r.json"))
    assert code == 1, (out, err)
    r = json.loads((tmp_path / "r.json").read_text())
    assert not r["passed"] and r["mismatched_outputs"] == ["y"]
    assert r["outputs"][0]["shape"] == [2, 3] and r["outputs"][0]["shape_b"] == [6, 1]
    assert "[E] FAILED | Mismatched outputs: ['y']" in out and "(2, 3) vs (6, 1)" in out
