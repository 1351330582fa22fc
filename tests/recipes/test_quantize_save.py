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


UNEXPORTABLE_PY = '''
import torch
from torch import nn


class SVD(nn.Module):
    """A Linear layer, then an op ONNX cannot express (singular values): calibrates, fails to export."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return torch.linalg.svdvals(self.fc(x).reshape(-1, 2, 2))


def make():
    torch.manual_seed(0)
    return SVD()
'''


def test_a_failed_export_leaves_an_existing_save_file_as_it_was(tmp_path: Path) -> None:
    """--save was written before --export ran: an export that failed (exit 1) had already replaced the user's
    earlier quantized model with this run's."""
    import contextlib
    import io

    from overdrive.cli.main import main

    (tmp_path / "svd_model.py").write_text(UNEXPORTABLE_PY)
    torch.save(torch.randn(32, 16), tmp_path / "calib.pt")
    saved = tmp_path / "q.pt"
    saved.write_bytes(b"the earlier run's model")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["quantize", "--model", f"{tmp_path / 'svd_model.py'}:make", "--calib-data", str(tmp_path / "calib.pt"),
                     "--batch-size", "8", "--calib-batches", "1", "--save", str(saved),
                     "--export", str(tmp_path / "q.onnx")])
    assert code == 1 and "svdvals" in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
    assert saved.read_bytes() == b"the earlier run's model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.pt", "q.pt", "svd_model.py"]  # no temporary left


def test_a_missing_calibration_file_is_refused_before_the_model_is_built(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo'd --calib-data was named only after the model was built (the digits model trained for seconds)."""
    import overdrive.recipes.quantize as q

    def built(*_a: object, **_k: object) -> None:
        raise AssertionError("the model was built before the calibration path was checked")

    monkeypatch.setattr(q, "load_model", built)
    missing = str(tmp_path / "calbi.pt")
    with pytest.raises(UsageError, match=r"--calib-data '.*calbi.pt' does not exist; save the model's inputs"):
        run_quantize("digits", missing, "int8", "max", 99.99, 2, 64, None, None)
