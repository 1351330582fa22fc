"""--checkpoint files that are not weights, as users mix them up: a save_pretrained / run folder, a NumPy array
or archive, a TorchScript archive. Each is named for what it is, not called a missing file or a pickled model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.recipes.model_spec import load_checkpoint


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_folder_is_named_with_the_weight_files_it_holds(tmp_path: Path) -> None:
    run = tmp_path / "run1"
    run.mkdir()
    torch.save(_net().state_dict(), run / "model.pt")
    (run / "config.json").write_text("{}")
    with pytest.raises(UsageError, match=r"is a folder, not a weights file; it holds model\.pt: give one"):
        load_checkpoint(_net(), run)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="is a folder.*no weight file"):
        load_checkpoint(_net(), tmp_path / "empty")


def test_quantize_names_a_checkpoint_folder_before_calibrating(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.py").write_text("from torch import nn\ndef make():\n    return nn.Linear(4, 2)\n")
    np.save(tmp_path / "calib.npy", np.zeros((4, 4), np.float32))
    code = main(["quantize", "--model", f"{tmp_path / 'm.py'}:make", "--checkpoint", str(tmp_path),
                 "--calib-data", str(tmp_path / "calib.npy"), "--no-progress"])
    assert code == 2
    assert "is a folder, not a weights file" in capsys.readouterr().err


def test_numpy_and_torchscript_files_are_named(tmp_path: Path) -> None:
    np.save(tmp_path / "w.npy", np.zeros(3))
    np.savez(tmp_path / "w.npz", a=np.zeros(3))
    torch.jit.script(_net()).save(str(tmp_path / "scripted.pt"))
    with pytest.raises(UsageError, match=r"is a NumPy array file \(np.save\), not weights"):
        load_checkpoint(_net(), tmp_path / "w.npy")
    with pytest.raises(UsageError, match=r"is a NumPy archive \(np.savez\), not weights"):
        load_checkpoint(_net(), tmp_path / "w.npz")
    with pytest.raises(UsageError, match=r"is a TorchScript archive .*torch.jit.load\(path\).state_dict\(\)"):
        load_checkpoint(_net(), tmp_path / "scripted.pt")


def test_whole_pickled_model_is_still_named_as_such(tmp_path: Path) -> None:
    torch.save(_net(), tmp_path / "whole.pt")
    with pytest.raises(UsageError, match="holds pickled Python objects"):
        load_checkpoint(_net(), tmp_path / "whole.pt")
    src = _net()
    torch.save(src.state_dict(), tmp_path / "sd.pt")
    dst = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    load_checkpoint(dst, tmp_path / "sd.pt")
    assert torch.equal(dst[0].weight, src[0].weight)
