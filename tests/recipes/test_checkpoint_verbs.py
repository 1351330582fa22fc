"""``--checkpoint`` on build and quantize: the .sparse24.pt that ``overdrive sparsify`` writes (and plain state_dicts)
load into the --model factory's model, so a pruned model reaches an engine or int8 without Python. Reference: the
pruned model itself in eager fp32 (engine: ONNX Runtime fp32, atol 1e-5); the quantized weights keep the 2:4 zeros."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overdrive.cli.main import main
from overdrive.sparsity import is_2to4, sparsify
from overdrive.sparsity.export import save_compressed

FACTORY = """import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
"""


@pytest.fixture()
def pruned(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    (tmp_path / "m.py").write_text(FACTORY)
    ns: dict = {}
    exec(FACTORY, ns)  # noqa: S102 - the test's own factory
    model = ns["make"]().eval()
    handle = sparsify(model)
    save_compressed(handle, tmp_path / "m.sparse24.pt")
    handle.remove()
    return tmp_path, model


def test_build_from_a_sparse24_checkpoint(pruned: tuple[Path, torch.nn.Module]) -> None:
    from overdrive.engine import Engine

    folder, model = pruned
    code = main(["build", "--model", f"{folder / 'm.py'}:make", "--checkpoint", str(folder / "m.sparse24.pt"),
                 "--shapes", "input:4x32", "--device", "cpu", "--save-engine", str(folder / "m.engine"), "--no-progress"])
    assert code in (0, None)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(Engine.load(folder / "m.engine")(x), want, atol=1e-5, rtol=1e-5)


def test_quantize_a_sparse24_checkpoint_keeps_the_zeros(pruned: tuple[Path, torch.nn.Module]) -> None:
    from overdrive.recipes.quantize import load_quantized

    folder, _ = pruned
    torch.save([torch.randn(16, 32, generator=torch.Generator().manual_seed(2))], folder / "calib.pt")
    code = main(["quantize", "--model", f"{folder / 'm.py'}:make", "--checkpoint", str(folder / "m.sparse24.pt"),
                 "--calib-data", str(folder / "calib.pt"), "--save", str(folder / "q.pt"), "--no-progress"])
    assert code in (0, None)
    q = load_quantized(str(folder / "q.pt"))
    weights = [m.weight for m in q.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) == 2 and all(is_2to4(w) for w in weights)


def test_checkpoint_errors_are_one_line_before_work(pruned: tuple[Path, torch.nn.Module],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    folder, _ = pruned
    assert main(["build", "--onnx", str(folder / "x.onnx"), "--checkpoint", str(folder / "m.sparse24.pt"),
                 "--save-engine", str(folder / "e.engine")]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["quantize", "--model", f"{folder / 'm.py'}:make", "--checkpoint", str(folder / "missing.pt"),
                 "--calib-data", "digits"]) == 2
    assert "does not exist" in capsys.readouterr().err
