"""A file written by ``overdrive quantize --save`` names the model factory that :func:`load_quantized` runs to
rebuild the float model. Naming code is running code: the factory runs only when the file is signed with the
user's key (``save_quantized`` signs it) or the caller says ``trust=True``; an unsigned or foreign file is
refused before anything is imported, naming the file and the ways to load it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.config import INT8_DEFAULT
from overdrive.recipes.quantize import load_quantized, save_quantized


def _calibrated(model: nn.Module, x: torch.Tensor) -> nn.Module:
    from overdrive.quant.api import quantize

    return quantize(model, INT8_DEFAULT, lambda m: m(x), fidelity=False)


def _crafted(tmp_path: Path, spec: str) -> Path:
    """A file as ``--save`` writes it, for ``nn.Linear(4, 2)``, naming ``spec`` and carrying no signature."""
    save_quantized(_calibrated(nn.Linear(4, 2), torch.randn(8, 4)), INT8_DEFAULT, spec, str(tmp_path / "signed.pt"))
    payload = torch.load(tmp_path / "signed.pt", weights_only=True)
    del payload["model_signature"]
    path = tmp_path / "crafted.pt"
    torch.save(payload, path)
    return path


def _evil_module(tmp_path: Path, marker: Path) -> Path:
    src = tmp_path / "evil_factory.py"
    src.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                   "import torch\n\ndef make():\n    return torch.nn.Linear(4, 2)\n")
    return src


def test_unsigned_file_does_not_run_the_factory_it_names(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = _crafted(tmp_path, f"{_evil_module(tmp_path, marker)}:make")
    with pytest.raises(UsageError) as err:
        load_quantized(str(path))
    assert not marker.exists()
    msg = str(err.value)
    assert str(path) in msg and "not signed" in msg and "trust=True" in msg and "model=" in msg


def test_unsigned_file_cannot_call_a_library_function(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = _crafted(tmp_path, f"os:system('touch {marker}')")
    with pytest.raises(UsageError, match="not signed"):
        load_quantized(str(path))
    assert not marker.exists()


def test_a_signature_for_another_spec_does_not_verify(tmp_path: Path) -> None:
    save_quantized(_calibrated(nn.Linear(4, 2), torch.randn(8, 4)), INT8_DEFAULT, "torch.nn:Identity", str(tmp_path / "mine.pt"))
    payload = torch.load(tmp_path / "mine.pt", weights_only=True)
    marker = tmp_path / "marker"
    payload["model"] = f"{_evil_module(tmp_path, marker)}:make"
    torch.save(payload, tmp_path / "edited.pt")
    with pytest.raises(UsageError, match="does not verify"):
        load_quantized(str(tmp_path / "edited.pt"))
    assert not marker.exists()


def test_trust_or_an_explicit_model_loads_an_unsigned_file(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = _crafted(tmp_path, f"{_evil_module(tmp_path, marker)}:make")
    torch.manual_seed(0)
    assert isinstance(load_quantized(str(path), model=nn.Linear(4, 2)), nn.Module)
    assert not marker.exists()
    assert isinstance(load_quantized(str(path), trust=True), nn.Module)
    assert marker.exists()  # trusted: the factory ran, as asked


def test_own_saves_and_builtin_models_load_without_trust(tmp_path: Path) -> None:
    from overdrive.recipes.model_spec import load_model

    save_quantized(_calibrated(load_model("digits"), torch.randn(8, 1, 8, 8)), INT8_DEFAULT, "digits", str(tmp_path / "alias.pt"))
    assert isinstance(load_quantized(str(tmp_path / "alias.pt")), nn.Module)
    spec = f"{_evil_module(tmp_path, tmp_path / 'marker')}:make"
    save_quantized(_calibrated(nn.Linear(4, 2), torch.randn(8, 4)), INT8_DEFAULT, spec, str(tmp_path / "own.pt"))  # this user's signature
    assert isinstance(load_quantized(str(tmp_path / "own.pt")), nn.Module)
