"""trtexec lines pasted from NVIDIA's best-practices guide and forum posts: the profiling line (``--useSpinWait
--separateProfileRun --dumpProfile --profilingVerbosity=detailed``) runs, ``--dumpProfile`` prints the per-layer
profile the run measured (the rows of ``--exportProfile``), a build line carrying trtexec's run flags builds, a
build-and-run ``--onnx`` line given to exec names the two commands, and a TensorRT calibration cache given as
``--calib`` is named for what it is. Hand-made ONNX models on the onnxruntime backend (fast, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from overdrive.cli.main import main

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto as T, helper as h, numpy_helper  # noqa: E402


def _onnx(path: Path) -> Path:
    """'input' (B, 4) -> MatMul -> Relu -> 'output' (B, 3)."""
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    g = h.make_graph([h.make_node("MatMul", ["input", "W"], ["mm"], name="fc"),
                      h.make_node("Relu", ["mm"], ["output"], name="act")], "g",
                     [h.make_tensor_value_info("input", T.FLOAT, ["B", 4])],
                     [h.make_tensor_value_info("output", T.FLOAT, ["B", 3])], [numpy_helper.from_array(w, "W")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("trtexec_more")
    model = _onnx(d / "m.onnx")
    assert main(["build", f"--onnx={model}", f"--saveEngine={d / 'm.engine'}", "--backend", "onnxruntime",
                 "--minShapes=input:1x4", "--optShapes=input:2x4", "--maxShapes=input:8x4"]) == 0
    return d / "m.engine"


def test_build_line_with_trtexec_run_flags_builds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trtexec --onnx=m.onnx --saveEngine=m.plan --useCudaGraph --profilingVerbosity=detailed ...``: the build
    runs nothing, so each run flag is noted (with where it goes) rather than a "No such option" error."""
    model = _onnx(tmp_path / "m.onnx")
    flags = ["--useCudaGraph", "--noDataTransfers", "--useSpinWait", "--separateProfileRun", "--dumpProfile"]
    assert main(["build", f"--onnx={model}", f"--saveEngine={tmp_path / 'm.plan'}", "--shapes=input:2x4",
                 "--backend", "onnxruntime", "--profilingVerbosity=detailed", *flags]) == 0
    err = capsys.readouterr().err
    for flag in flags:
        assert f"[I] {flag} has no effect here: overdrive build runs no inference; give {flag} to overdrive exec" in err
    assert "[I] --profilingVerbosity has no effect here:" in err
    assert (tmp_path / "m.plan").exists()


def test_dump_profile_prints_the_measured_layers(engine: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof.json"
    assert main(["exec", f"--loadEngine={engine}", "--shapes=input:4x4", "--iterations=2", "--duration=0",
                 "--warmUp=0", "--useSpinWait", "--separateProfileRun", "--profilingVerbosity=detailed",
                 "--dumpProfile", f"--exportProfile={prof}"]) == 0
    captured = capsys.readouterr()
    assert "[I] --useSpinWait has no effect here:" in captured.err
    assert "[I] --profilingVerbosity has no effect here:" in captured.err
    out = captured.out
    assert out.index("=== Performance summary ===") < out.index("=== Profile (10 iterations) ===")
    rows = json.loads(prof.read_text())[1:]  # the printed table is --exportProfile's rows, slowest first
    assert rows and any("(MatMul)" in r["name"] for r in rows)
    for r in rows:
        assert f"{r['timeMs']:.2f}" in out and f"   {r['name']}" in out
    total = [ln for ln in out.splitlines() if ln.endswith("   Total")]
    assert len(total) == 1 and f"{sum(r['timeMs'] for r in rows):.2f}" in total[0]


def test_dump_profile_alone_leaves_no_file(engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["exec", f"--loadEngine={engine}", "--iterations=1", "--duration=0", "--warmUp=0",
                 "--dumpProfile"]) == 0
    assert "=== Profile (10 iterations) ===" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_exec_given_a_trtexec_onnx_line_names_both_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trtexec --onnx=m.onnx --fp16 --shapes=...`` builds and runs; pasted into exec, click said "No such option
    '--onnx'. Did you mean '--json'?"."""
    model = _onnx(tmp_path / "m.onnx")
    for line in ([f"--onnx={model}", "--fp16", "--shapes=input:2x4", "--useCudaGraph"], ["--onnx", str(model)]):
        assert main(["exec", *line]) == 2
        err = capsys.readouterr().err
        assert f"overdrive build --onnx {model} --saveEngine m.engine" in err
        assert "overdrive exec --loadEngine m.engine" in err and "No such option" not in err


def test_tensorrt_calibration_cache_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``trtexec --int8 --calib=model.cache`` reads TensorRT's scale cache; pasted, the loader only said the file
    was "not a tensor file overdrive can read safely (UnpicklingError)"."""
    model = _onnx(tmp_path / "m.onnx")
    cache = tmp_path / "model.cache"
    cache.write_text("TRT-8601-EntropyCalibration2\ninput: 3c010a14\nmm: 3d8f5c29\noutput: 3e4ccccd\n")
    assert main(["build", f"--onnx={model}", f"--saveEngine={tmp_path / 'm.plan'}", "--int8", f"--calib={cache}",
                 "--shapes=input:2x4"]) == 2
    err = capsys.readouterr().err
    assert "is a TensorRT calibration cache (EntropyCalibration2" in err and "not calibration data" in err
    assert not (tmp_path / "m.plan").exists()
