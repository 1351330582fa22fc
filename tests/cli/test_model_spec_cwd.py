"""`pkg.module:factory` finds a package in the current folder, as `python -m` would, with no PYTHONPATH=.;
and sys.path is left as it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from overdrive._utils.errors import UsageError
from overdrive._utils.model_spec import load_factory


def test_package_in_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cwdpkg_a").mkdir()
    (tmp_path / "cwdpkg_a" / "__init__.py").write_text("")
    (tmp_path / "cwdpkg_a" / "models.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 3)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    assert load_factory("cwdpkg_a.models:make").out_features == 3
    assert sys.path == before


def test_error_names_the_spec_not_a_flag_the_user_did_not_type() -> None:
    with pytest.raises(UsageError, match=r"^model spec 'no_such_pkg_x.models:make': cannot import"):
        load_factory("no_such_pkg_x.models:make")
