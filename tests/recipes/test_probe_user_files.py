"""Users' own files through the recipes: DDP / torch.compile checkpoints, whole pickled models, NumPy
calibration files, dynamic-scale configs with several batches, --input-shape on a two-input model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.recipes.calibration import load_calibration
from overdrive.recipes.model_spec import load_checkpoint

MODEL_FILE = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(8, 32)

    def forward(self, x, y):
        return self.a(x) + self.b(y)

def make_model():
    torch.manual_seed(0)
    return Net()

def make_two():
    return Two()
'''


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
@pytest.mark.parametrize("nested", [False, True])
def test_checkpoint_from_wrapped_model_loads(tmp_path: Path, prefix: str, nested: bool) -> None:
    src = _net()
    state = {prefix + k: v for k, v in src.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []}} if nested else state, path)
    dst = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    load_checkpoint(dst, path)
    x = torch.randn(5, 16)
    torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)


def test_prefix_kept_when_the_model_has_it(tmp_path: Path) -> None:
    wrapper = nn.Module()
    wrapper.module = _net()
    path = tmp_path / "ckpt.pt"
    torch.save(wrapper.state_dict(), path)
    fresh = nn.Module()
    fresh.module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    load_checkpoint(fresh, path)
    torch.testing.assert_close(fresh.module[0].weight, wrapper.module[0].weight, rtol=0, atol=0)


def test_whole_pickled_model_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "whole.pt"
    torch.save(_net(), path)
    with pytest.raises(UsageError, match=r"pickled Python objects.*state_dict\(\)") as info:
        load_checkpoint(_net(), path)
    assert "\x1b[" not in str(info.value)


def test_numpy_calibration_files(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((10, 16))  # float64, as NumPy makes it
    np.save(tmp_path / "c.npy", x)
    np.savez(tmp_path / "c.npz", x=x[:, :16].astype(np.float32), y=x[:, :8].astype(np.float32))
    calib = load_calibration(str(tmp_path / "c.npy"), batch_size=4)
    assert len(calib) == 3 and calib.batches[0][0].dtype == torch.float32
    torch.testing.assert_close(calib.batches[2][0], torch.from_numpy(x[8:]).float())

    class Two(nn.Module):
        def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return x

    named = load_calibration(str(tmp_path / "c.npz"), batch_size=5, model=Two())
    assert named.names == ("y", "x") and tuple(named.batches[0][0].shape) == (5, 8)


def test_numpy_object_array_is_refused_clearly(tmp_path: Path) -> None:
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UsageError, match=r"o\.npy.*not a NumPy file overdrive can read safely"):
        load_calibration(str(tmp_path / "o.npy"))


def test_dynamic_config_with_many_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fidelity pass stops the forward loop early with its own exception: not a calibration error."""
    from overdrive.recipes.quantize import load_quantized, run_quantize

    (tmp_path / "user_model.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    torch.save(torch.randn(64, 16), tmp_path / "calib.pt")
    result = run_quantize("user_model.py:make_model", "calib.pt", "int8_dynamic", "max", 99.99, 8, 8, None, None,
                          save_path="q.pt")
    assert result["fidelity"]["cosine"] > 0.99
    assert isinstance(load_quantized("q.pt"), nn.Module)


def test_input_shape_on_two_input_model_is_refused_before_pruning(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.recipes.sparsify import sparsify_checkpoint
    from overdrive.sparsity.config import SparsityConfig

    (tmp_path / "user_model.py").write_text(MODEL_FILE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"--input-shape 2,16 gives one input but Two\.forward takes 2 \(x, y\)"):
        sparsify_checkpoint("user_model.py:make_two", None, "out.pt", SparsityConfig(), (2, 16), allow_untrained=True)
    assert not (tmp_path / "out.pt").exists()
