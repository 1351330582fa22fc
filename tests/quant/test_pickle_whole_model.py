"""A quantized model whose adds were traced (per-module classes made at run time) pickles whole: torch.save /
torch.load, in this process and in a new one, and copy.deepcopy give the same outputs bit for bit."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from overdrive import quant

ROOT = Path(__file__).resolve().parents[2]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8, H, W)
        return x + F.relu(self.conv(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = _Block()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = self.block(h) + h  # an add in the root too: the root is a traced copy
        return self.fc(h.mean((2, 3)))


def _quantized() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    model = quant.quantize(_Net().eval(), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    assert "_overdrive_fx_code" in vars(type(model)) and "_overdrive_fx_code" in vars(type(model.block))
    return model, x


def test_torch_save_whole_traced_model(tmp_path: Path) -> None:
    model, x = _quantized()
    path = tmp_path / "whole.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert isinstance(loaded, _Net) and isinstance(loaded.block, _Block)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))  # same fake-quant graph and amax: bit-identical
    assert quant.summary(loaded)["layers"] == quant.summary(model)["layers"]
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))


def test_torch_load_in_a_new_process(tmp_path: Path) -> None:
    model, x = _quantized()
    torch.save(model, tmp_path / "whole.pt")
    with torch.no_grad():
        torch.save({"x": x, "y": model(x)}, tmp_path / "io.pt")
    code = ("import torch; m = torch.load('whole.pt', weights_only=False); io = torch.load('io.pt'); "
            "assert type(m).__name__ == '_Net', type(m); "
            "assert torch.equal(m(io['x']), io['y']), 'outputs differ'")
    env_path = f"{ROOT}"
    run = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {env_path!r}); {code}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
