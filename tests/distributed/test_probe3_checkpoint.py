"""Saving over an existing step folder, and loading a checkpoint of another model.

Before: ``save`` removed an existing ``step_N`` before writing the new one, so a resumed run that saved at the
step it loaded and stopped part way (keep=1) was left with no checkpoint; a checkpoint holding layers the model
lacks loaded silently (DCP reads only the keys asked for), and a missing key or shape was named one at a time.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.train import Trainer


def _trainer(model: nn.Module | None = None, steps: int = 1) -> Trainer:
    torch.manual_seed(0)
    m = model if model is not None else nn.Linear(4, 3)
    tr = Trainer(m, torch.optim.Adam(m.parameters(), lr=0.1), strategy="ddp", progress=False)
    for _ in range(steps):
        tr.train_step((torch.randn(2, 4), torch.randint(0, 3, (2,))))
    return tr


def _weights(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


@pytest.mark.parametrize("where", ["dcp", "manifest"])
def test_an_interrupted_save_over_a_step_folder_keeps_the_old_one(group: None, tmp_path: Path, where: str) -> None:
    root = tmp_path / "ckpt"
    first = _trainer()
    saved = _weights(first)
    path = odist.checkpoint.save(root, first, keep=1)
    second = _trainer()
    with torch.no_grad():
        for p in second.model.parameters():
            p.add_(1.0)  # another state at the same step count
    target = (dcp, "save") if where == "dcp" else (odist.checkpoint.files, "write_manifest")
    with mock.patch.object(*target, side_effect=KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            odist.checkpoint.save(root, second, keep=1)
    assert odist.checkpoint.latest(root) == path  # before: None, the old folder removed first
    fresh = _trainer(steps=0)
    odist.checkpoint.load(path, fresh)
    for k, v in _weights(fresh).items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    # the next save at that step finishes and replaces it, leaving nothing beside it
    odist.checkpoint.save(root, second, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [path.name]
    odist.checkpoint.load(path, fresh)
    for k, v in _weights(fresh).items():
        torch.testing.assert_close(v, _weights(second)[k], rtol=0, atol=0)


def test_a_checkpoint_with_extra_layers_is_refused_naming_them(group: None, tmp_path: Path) -> None:
    big = _trainer(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3)))
    path = odist.checkpoint.save(tmp_path / "ckpt", big)
    small = _trainer(nn.Sequential(nn.Linear(4, 3)), steps=0)
    before = _weights(small)
    with pytest.raises(UsageError, match=r"another model \(in the checkpoint, not in the model: 1\.bias, 1\.weight\)"):
        odist.checkpoint.load(path, small)
    for k, v in _weights(small).items():  # nothing was loaded
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_missing_keys_and_shapes_are_all_named(group: None, tmp_path: Path) -> None:
    path = odist.checkpoint.save(tmp_path / "ckpt", _trainer(nn.Linear(4, 3)))
    with pytest.raises(UsageError, match=r"missing from the checkpoint: 0\.bias, 0\.weight; in the checkpoint, "
                                         r"not in the model: bias, weight"):
        odist.checkpoint.load(path, _trainer(nn.Sequential(nn.Linear(4, 3)), steps=0))
    with pytest.raises(UsageError, match=r"Size mismatch: weight: saved \(3, 4\), model \(5, 4\), "
                                         r"bias: saved \(3,\), model \(5,\)"):
        odist.checkpoint.load(path, _trainer(nn.Linear(4, 5), steps=0))
