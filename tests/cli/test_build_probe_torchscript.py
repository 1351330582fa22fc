"""``overdrive build --torchscript``: dynamic profiles build the module on ONNX Runtime (as the Python API does),
other backends are refused in one line, and a ``torch.save(model)`` pickle is named for what it is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.cli.main import main
from overdrive.engine.runtime import Engine


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def test_dynamic_profile_builds_and_matches_the_module(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("onnxruntime")
    monkeypatch.chdir(tmp_path)
    net = _net()
    torch.jit.save(torch.jit.trace(net, torch.randn(2, 8)), "m.ts")
    code = main(["build", "--torchscript", "m.ts", "--save-engine", "m.engine", "--device", "cpu", "--no-progress",
                 "--minShapes", "x:1x8", "--optShapes", "x:4x8", "--maxShapes", "x:16x8"])
    assert code == 0
    engine = Engine.load("m.engine")
    assert engine.info["backend"] == "onnxruntime"
    for batch in (1, 7, 16):  # every batch in the profile, not only the opt one
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))
        out = engine(x)
        out = out[0] if isinstance(out, (list, tuple)) else out
        torch.testing.assert_close(out, net(x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra, needle", [
    (["--backend", "inductor"], "--backend inductor"),
    (["--fp16"], "fp16 on cpu"),
])
def test_dynamic_profile_elsewhere_is_one_line(extra, needle, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    torch.jit.save(torch.jit.trace(_net(), torch.randn(2, 8)), "m.ts")
    code = main(["build", "--torchscript", "m.ts", "--save-engine", "m.engine", "--device", "cpu", "--no-progress",
                 "--min-shapes", "x:1x8", "--max-shapes", "x:16x8", *extra])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert needle in err and "--shapes" in err and "--model file.py:factory" in err
    assert not (tmp_path / "m.engine").exists()


def test_pickled_module_is_named_with_what_to_pass(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    torch.save(_net(), "model.pt")  # the whole module pickled, not TorchScript
    code = main(["build", "--torchscript", "model.pt", "--save-engine", "m.engine", "--shapes", "x:2x8"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "pickled Python module" in err and "Sequential" in err and "--model file.py:factory" in err
    assert "constants.pkl" not in err


def test_state_dict_is_named_with_what_to_pass(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    torch.save(_net().state_dict(), "weights.pt")
    code = main(["build", "--torchscript", "weights.pt", "--save-engine", "m.engine", "--shapes", "x:2x8"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "state_dict" in err and "--checkpoint weights.pt" in err, err
