"""--model / --checkpoint errors name the flag, the value and what is wrong: a state_dict that does not fit used to
print only torch's first line ("Error(s) in loading state_dict for Sequential:"), a corrupt file torch's
"unpack requires a buffer of 4 bytes" with no flag or file, and a factory that raises its message without the spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.recipes.model_spec import load_checkpoint, load_model


def test_a_state_dict_that_does_not_fit_names_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    torch.save({"bad": torch.zeros(1)}, path)
    with pytest.raises(UsageError, match=r'--checkpoint .*bad.pt does not fit the model: Missing key\(s\).*"0.weight".*'
                                         r'Unexpected key\(s\).*"bad"'):
        load_checkpoint(nn.Sequential(nn.Linear(4, 4)), path)


def test_a_corrupt_file_names_the_flag_and_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.pt"
    path.write_bytes(b"junk\n")
    with pytest.raises(UsageError, match=r"--checkpoint '.*junk.pt' cannot be read as weights"):
        load_checkpoint(nn.Linear(4, 4), path)


def test_a_factory_that_raises_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "boomfactory.py").write_text("def boom():\n    raise RuntimeError('factory exploded')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"--model 'boomfactory.py:boom': boom\(\) raised RuntimeError: factory exploded"):
        load_model("boomfactory.py:boom")
