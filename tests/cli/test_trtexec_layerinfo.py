"""trtexec's layer and build flags on build / exec: ``--dumpLayerInfo`` prints and ``--exportLayerInfo`` writes the
engine's layers (trtexec's ``Layers`` / ``Bindings`` JSON), ``--noTF32`` and ``--builderOptimizationLevel`` say what
they do here, the run flags of a build-and-run line (``--iterations``, ``--streams``, ...) are accepted with a note,
and a ``--torchscript`` build with a dynamic profile says why it went to ONNX Runtime (it read "asked for")."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from overdrive.cli.common import format_layer_info, layer_info
from overdrive.cli.main import main


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _onnx(tmp_path: Path) -> Path:
    path = tmp_path / "net.onnx"
    torch.manual_seed(0)
    torch.onnx.export(_Net().eval(), (torch.randn(2, 8),), str(path), input_names=["input"], output_names=["logits"],
                      dynamo=False)
    return path


def test_layer_info_on_build_and_exec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """trtexec's ``--dumpLayerInfo`` / ``--exportLayerInfo=FILE`` were "No such option" on both verbs."""
    pytest.importorskip("onnxruntime")
    onnx_path, eng = _onnx(tmp_path), tmp_path / "net.engine"
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(eng), "--shapes", "input:2x8", "--no-progress",
                 "--dumpLayerInfo", f"--exportLayerInfo={tmp_path / 'build.json'}"]) == 0
    out = capsys.readouterr().out
    built = json.loads((tmp_path / "build.json").read_text())
    assert built["Bindings"] == ["input", "logits"]
    layers = built["Layers"]
    assert layers and all({"Name", "LayerType", "Inputs", "Outputs"} <= set(layer) for layer in layers)
    assert "Gemm" in {layer["LayerType"] for layer in layers}
    # the layers chain from the input binding to the output binding, weights kept apart from the activations
    assert layers[0]["Inputs"] == [{"Name": "input"}] and layers[-1]["Outputs"] == [{"Name": "logits"}]
    assert any("fc1.weight" in layer.get("Weights", []) for layer in layers)
    assert "[I] Layer Information (onnxruntime," in out and "[I] Bindings: input, logits" in out
    assert all(f"[I] {layer['Name']} ({layer['LayerType']})" in out for layer in layers)

    assert main(["exec", "--loadEngine", str(eng), "--iterations", "1", "--duration", "0", "--warmUp", "0",
                 "--dumpLayerInfo", "--exportLayerInfo", str(tmp_path / "exec.json")]) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "exec.json").read_text()) == built
    assert out.index("[I] Layer Information") < out.index("=== Performance summary ===")  # before the run's summary


def test_layer_info_refuses_a_missing_folder_before_the_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    onnx_path = _onnx(tmp_path)
    code = main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "e.engine"), "--shapes", "input:2x8",
                 "--exportLayerInfo", str(tmp_path / "no" / "layers.json")])
    assert code != 0 and "--export-layer-info" in capsys.readouterr().err
    assert not (tmp_path / "e.engine").exists()


def test_program_layers_name_modules_weights_and_placement() -> None:
    """An inductor engine's layers come from its exported program: one per leaf module (named by its path in the
    model, its weights by state-dict name), one per op of the model's own forward; an int8/fp8 build's placement
    (``engine.info["layers"]``) is each layer's ``Precision``."""
    from overdrive.engine.sources import save_exported

    torch.manual_seed(0)
    ep = torch.export.export(_Net().eval(), (torch.randn(2, 8),))
    engine = SimpleNamespace(header={"outputs": [{"name": "logits"}], "backend": "inductor", "backend_meta": {}},
                             sections={"exported_program": save_exported(ep)}, input_names=["x"],
                             info={"layers": {"fc1": "int8 GEMM (torch._int_mm)"}})
    info = layer_info(engine)
    names = [layer["Name"] for layer in info["Layers"]]
    assert names == ["fc1", "relu", "fc2"], names
    fc1, relu, fc2 = info["Layers"]
    assert fc1["LayerType"] == "Linear" and fc1["Weights"] == ["fc1.weight", "fc1.bias"]
    assert fc1["Precision"] == "int8 GEMM (torch._int_mm)" and "Precision" not in fc2
    assert fc1["Inputs"] == [{"Name": "x", "Dimensions": [2, 8], "Datatype": "float32"}]
    assert relu["Inputs"] == fc1["Outputs"] and fc2["Inputs"] == relu["Outputs"]
    assert fc2["Outputs"][0]["Name"] == "logits" and fc2["Outputs"][0]["Dimensions"] == [2, 4]
    assert info["Bindings"] == ["x", "logits"]
    text = format_layer_info(info, "inductor")
    assert "[I] fc1 (Linear) [int8 GEMM (torch._int_mm)]: x[2x8] -> " in text


def test_no_tf32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--noTF32`` was "No such option"; fp32 builds run IEEE fp32 already (said in one line), and beside
    ``--precision tf32`` it asks for the opposite and is refused."""
    pytest.importorskip("onnxruntime")
    onnx_path = _onnx(tmp_path)
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "a.engine"), "--shapes", "input:2x8",
                 "--noTF32"]) == 0
    assert "[I] --noTF32 has no effect here: fp32 builds already run IEEE fp32" in capsys.readouterr().err
    code = main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "b.engine"), "--shapes", "input:2x8",
                 "--noTF32", "--precision", "tf32"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "--noTF32" in err and "tf32" in err
    assert not (tmp_path / "b.engine").exists()


@pytest.mark.parametrize("level, tuned", [(5, True), (4, True), (3, False), (0, False)])
def test_builder_optimization_level(level: int, tuned: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """trtexec's ``--builderOptimizationLevel`` (0-5, default 3): levels above the default spend build time on more
    kernel choices, as Inductor's max-autotune; the build is asked for exactly that."""
    import overdrive.recipes.build as recipe
    from overdrive._utils.errors import UsageError

    seen: dict[str, object] = {}

    def fake_build(**kwargs: object) -> None:
        seen.update(kwargs)
        raise UsageError("stop here")

    monkeypatch.setattr(recipe, "build_engine", fake_build)
    main(["build", "--onnx", str(tmp_path / "m.onnx"), "--saveEngine", str(tmp_path / "m.engine"),
          "--shapes", "input:2x8", f"--builderOptimizationLevel={level}"])
    assert seen["max_autotune"] is tuned
    assert f"--builderOptimizationLevel {level}" in capsys.readouterr().err


def test_builder_optimization_level_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxruntime")
    onnx_path = _onnx(tmp_path)
    for bad in (["--builderOptimizationLevel=6"], ["--builderOptimizationLevel=2", "--max-autotune"]):
        code = main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "m.engine"),
                     "--shapes", "input:2x8", *bad])
        assert code != 0 and "--builderOptimizationLevel" in capsys.readouterr().err
    # on onnxruntime, which has no kernel tuning, the level (as --max-autotune) is said to have had no effect
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "m.engine"), "--shapes", "input:2x8",
                 "--backend", "onnxruntime", "--builderOptimizationLevel=5"]) == 0
    assert "[I] --builderOptimizationLevel 5 had no effect: it tunes Inductor's kernels" in capsys.readouterr().err


def test_run_and_typing_flags_are_accepted_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxruntime")
    onnx_path, eng = _onnx(tmp_path), tmp_path / "m.engine"
    flags = ["--iterations=100", "--duration=3", "--warmUp=200", "--threads", "--streams=2", "--infStreams=2",
             "--stronglyTyped", "--versionCompatible"]
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(eng), "--shapes", "input:2x8", *flags]) == 0
    err = capsys.readouterr().err
    for flag in flags:
        assert f"[I] {flag.split('=')[0]} has no effect here:" in err
    assert main(["exec", "--loadEngine", str(eng), "--iterations", "1", "--duration", "0", "--warmUp", "0",
                 "--streams=2", "--infStreams=2", "--threads"]) == 0
    err = capsys.readouterr().err
    for flag in ("--streams", "--infStreams", "--threads"):
        assert f"[I] {flag} has no effect here:" in err


def test_scripted_dynamic_build_says_why_onnxruntime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """With no --backend, the summary read "backend onnxruntime (asked for)"; it now gives the reason, and an
    explicit --backend onnxruntime still reads "asked for"."""
    pytest.importorskip("onnxruntime")
    monkeypatch.chdir(tmp_path)
    torch.jit.save(torch.jit.trace(_Net().eval(), torch.randn(2, 8)), "m.ts")
    dyn = ["--minShapes", "x:1x8", "--optShapes", "x:4x8", "--maxShapes", "x:8x8", "--no-progress"]
    assert main(["build", "--torchscript", "m.ts", "--saveEngine", "a.engine", *dyn]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert "backend onnxruntime (TorchScript with a dynamic profile" in line and "asked for" not in line
    assert main(["build", "--torchscript", "m.ts", "--saveEngine", "b.engine", "--backend", "onnxruntime", *dyn]) == 0
    assert "backend onnxruntime (asked for)" in capsys.readouterr().out
