"""One reader of --model and --calib for every verb: ``file.py:factory`` works for build, quantize and
sparsify (it failed for build and quantize before); pickled models and pickled calibration objects are
refused with a one-line error (a data file must not run code)."""

from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main

MODEL_PY = '''
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 16))
'''


@pytest.fixture()
def model_py(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_PY)
    return path


def _run(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


def test_file_factory_for_every_verb(tmp_path: Path, model_py: Path) -> None:
    spec = f"{model_py}:build"
    calib = tmp_path / "calib.pt"
    torch.save(torch.rand(16, 1, 8, 8), calib)
    code, err = _run(["quantize", "--model", spec, "--calib-data", str(calib), "--calib-batches", "1"])
    assert code == 0, err
    code, err = _run(["sparsify", "--model", spec, "--allow-untrained", "--out", str(tmp_path / "s.pt")])
    assert code == 0, err
    code, err = _run(["build", "--model", spec, "--shapes", "x:4x1x8x8", "--save-engine", str(tmp_path / "m.engine")])
    assert code == 0, err
    assert (tmp_path / "m.engine").is_file() and (tmp_path / "s.pt").is_file()
    code, err = _run(["compare", str(tmp_path / "m.engine"), spec])
    assert code == 0, err


def test_pickled_model_is_refused(tmp_path: Path) -> None:
    from overdrive.recipes.model_spec import load_model

    path = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    with pytest.raises(UsageError, match="does not unpickle models"):
        load_model(str(path))
    code, err = _run(["quantize", "--model", str(path), "--calib-data", "digits"])
    assert code == 2 and "does not unpickle" in err and len(err.strip().splitlines()) == 1


class _Marker:
    def __reduce__(self):  # noqa: ANN204 - what a malicious calibration file carries
        return (Path.write_text, (Path(self.target), "ran"))


def test_calibration_file_never_runs_code(tmp_path: Path, model_py: Path) -> None:
    from overdrive.recipes.model_spec import load_calibration

    marker = tmp_path / "marker"
    evil = _Marker()
    evil.target = str(marker)  # type: ignore[attr-defined]
    path = tmp_path / "calib.pt"
    with open(path, "wb") as f:
        pickle.dump([evil], f)
    with pytest.raises(UsageError, match="not a tensor file overdrive can read safely"):
        load_calibration(str(path))
    for verb in (["quantize", "--model", f"{model_py}:build", "--calib-data", str(path)],
                 ["build", "--model", f"{model_py}:build", "--shapes", "x:4x1x8x8", "--precision", "int8",
                  "--calib", str(path), "--save-engine", str(tmp_path / "e.engine")]):
        code, err = _run(verb)
        assert code == 2 and "read safely" in err, err
    assert not marker.exists()


def test_bad_specs_name_the_fix() -> None:
    from overdrive.recipes.model_spec import load_model

    with pytest.raises(UsageError, match="one of digits, docstrings"):
        load_model("resnet")
    with pytest.raises(UsageError, match="does not exist"):
        load_model("missing.py:build")
    with pytest.raises(UsageError, match="has no 'nope'"):
        load_model("torch.nn:nope")
    with pytest.raises(UsageError, match="with no arguments"):
        load_model("torch:zeros")
    with pytest.raises(UsageError, match="not a torch.nn.Module"):
        load_model("collections:OrderedDict")
