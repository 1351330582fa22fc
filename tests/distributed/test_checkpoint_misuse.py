"""Common misuses of checkpoint.save / load, each a one-line UsageError naming the value and the fix.

Before: loading the root folder (not a step_N folder) said "incomplete ... a save that did not finish"; a lambda in
``position`` raised a bare AttributeError from pickling; a root that is a file raised DCP's CheckpointException
(a BaseException, past ``except Exception``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.train import Trainer


def _trainer() -> Trainer:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    tr = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), strategy="ddp", progress=False)
    tr.train_step((torch.randn(2, 4), torch.randint(0, 3, (2,))))
    return tr


def test_loading_the_root_names_latest(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    odist.checkpoint.save(root, _trainer())
    with pytest.raises(UsageError, match=r"checkpoint root .*step_00000001.*checkpoint\.latest"):
        odist.checkpoint.load(root, _trainer())
    odist.checkpoint.load(odist.checkpoint.latest(root), _trainer())  # the fix the message gives works


def test_an_unpicklable_position_is_a_usage_error(group: None, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="position holds a value"):
        odist.checkpoint.save(tmp_path / "ckpt", _trainer(), position={"next": lambda: 1})
    assert not (tmp_path / "ckpt").exists()


def test_a_root_that_is_a_file_is_a_usage_error(group: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.write_text("not a folder")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        odist.checkpoint.save(root, _trainer())
    assert root.read_text() == "not a folder"


def test_latest_refuses_a_file_and_a_step_folder_instead_of_reporting_no_checkpoint(group: None, tmp_path: Path) -> None:
    """Before, both returned None: a resume written as ``latest(...) or start fresh`` trained from scratch."""
    root = tmp_path / "ckpt"
    odist.checkpoint.save(root, _trainer())
    step = odist.checkpoint.latest(root)
    assert step is not None
    with pytest.raises(UsageError, match=r"is one checkpoint, not a checkpoint root; pass its parent"):
        odist.checkpoint.latest(step)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match=r"that is a file, not a checkpoint root"):
        odist.checkpoint.latest(tmp_path / "afile")
    assert odist.checkpoint.latest(tmp_path / "missing") is None  # a first run: nothing saved yet
