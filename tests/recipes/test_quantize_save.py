"""``overdrive quantize --save FILE``: the quantized PyTorch model, written atomically, reloads with its amax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.recipes.quantize import load_quantized, run_quantize


def test_saved_quantized_model_reloads_with_the_same_accuracy(tmp_path: Path) -> None:
    from overdrive.cli.main import main
    from overdrive.recipes.data import load_digits

    path = tmp_path / "digits_int8.pt"
    result = run_quantize("digits", "digits", "int8", "max", 99.99, 2, 64, None, None, save_path=str(path))
    assert result["saved"] == str(path) and sorted(p.name for p in tmp_path.iterdir()) == ["digits_int8.pt"]
    model = load_quantized(str(path))
    assert any(k.endswith("amax") for k in model.state_dict())
    d = load_digits()
    with torch.no_grad():
        acc = float((model(d.x_test).argmax(1) == d.y_test).float().mean())
    assert acc == result["quantized_accuracy"]  # the same calibrated model, not a fresh one
    assert main(["quantize", "--calib-batches", "1", "--save", str(tmp_path / "cli.pt"), "--json", "-"]) == 0
    assert load_quantized(str(tmp_path / "cli.pt")) is not None


def test_load_quantized_refuses_other_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_quantized(str(tmp_path / "none.pt"))
    torch.save({"w": torch.zeros(1)}, tmp_path / "sd.pt")
    with pytest.raises(UsageError, match="not a file written by overdrive quantize --save"):
        load_quantized(str(tmp_path / "sd.pt"))
