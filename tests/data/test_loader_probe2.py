"""Iteration semantics a DataLoader user relies on: a second pass at one epoch is named (DataLoader reshuffles on
every pass), and an epoch resumes mid-way with exactly the batches not yet taken."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.data import ImageLoader
from tests.data.conftest import write_folder


def _collect(loader: ImageLoader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*list(loader))
    return torch.cat(xs), torch.cat(ys)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return write_folder(tmp_path / "imgs", 7, sizes=(16, 24))


def test_a_second_pass_without_set_epoch_is_named(small: Path) -> None:
    """A loop written for DataLoader(shuffle=True) (``for epoch in ...: for x, y in loader``) reshuffles and redraws
    the augmentations on every pass; here the epoch keys both, so without set_epoch every epoch trained on the same
    crops in the same order, with no word. The second pass now warns once; set_epoch, an eval loader or a pass cut
    short by a break do not."""
    opts = dict(batch_size=3, size=8, num_workers=0, pipeline="cpu", seed=1)
    loader = ImageLoader(small, **opts)
    first = _collect(loader)
    with pytest.warns(RuntimeWarning, match=r"new pass over the loader at epoch 0.*call loader.set_epoch\(epoch\)"):
        second = _collect(loader)
    assert torch.equal(first[0], second[0])  # what the warning says: the same crops, the same order
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _collect(loader)  # said once
        fresh = ImageLoader(small, **opts)
        for epoch in range(3):  # the documented loop
            fresh.set_epoch(epoch)
            _collect(fresh)
        ev = ImageLoader(small, train=False, **opts)  # no shuffle, no random crops: a repeat is meant
        _collect(ev)
        _collect(ev)
        cut = ImageLoader(small, **opts)
        for _ in cut:
            break
        _collect(cut)  # the first pass was cut short: this one is epoch 0's first whole pass


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(small: Path, workers: int, persistent: bool) -> None:
    """A checkpoint saved mid-epoch could not resume the loader there (no state_dict): a resumed run restarted the
    epoch, training twice on its first batches. Reference: the same epoch in one uninterrupted pass."""
    opts = dict(batch_size=2, size=8, num_workers=workers, persistent_workers=persistent, pipeline="cpu", seed=4,
                num_shards=2, shard_id=1)
    ref = ImageLoader(small, **opts)
    ref.set_epoch(3)
    full = list(ref)
    run = ImageLoader(small, **opts)
    run.set_epoch(3)
    for i, _ in enumerate(run):
        if i == 0:
            next(iter(run))  # a batch taken for logging does not move the count
        if i == 1:
            state = run.state_dict()
            break
    assert state["epoch"] == 3 and state["batches_taken"] == 2
    resumed = ImageLoader(small, **opts)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - 2
    for (xa, ya), (xb, yb) in zip(full[2:], rest):  # the same images, crops and flips
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert resumed.state_dict()["batches_taken"] == len(full)
    resumed.set_epoch(4)
    assert len(list(resumed)) == len(full)  # the next pass is a whole one again
    other = ImageLoader(small, **opts)
    other.load_state_dict(state)
    other.set_epoch(3)  # what fit does on resume: the same epoch keeps the position
    assert len(list(other)) == len(full) - 2
    other.load_state_dict(state)
    other.set_epoch(5)  # another epoch starts whole: the loaded position was epoch 3's
    assert len(list(other)) == len(full)
    run.close(), resumed.close(), ref.close(), other.close()


def test_a_state_from_another_loader_is_refused(small: Path) -> None:
    opts = dict(batch_size=2, size=8, num_workers=0, pipeline="cpu", seed=4)
    state = ImageLoader(small, **opts).state_dict()
    with pytest.raises(UsageError, match=r"differs from this one in batch_size \(saved 2, here 3\)"):
        ImageLoader(small, **{**opts, "batch_size": 3}).load_state_dict(state)
    with pytest.raises(UsageError, match="takes what ImageLoader.state_dict"):
        ImageLoader(small, **opts).load_state_dict({"epoch": 1})
