"""``fit`` over data that records its own position (``overdrive.data.ImageLoader``'s ``state_dict``, as torchdata's
StatefulDataLoader) reads it without a batch of look-ahead, so the loader's ``state_dict`` taken between two trained
batches (a preemption handler saving after a ``train_step``) names exactly the batches trained on: the resumed run
trains the uninterrupted run's remaining batches and ends with its weights, with and without a partial accumulation
at the epoch's end. Before, the look-ahead that flags the epoch's last batch had taken one batch more from the loader,
and the resumed run skipped it. A plain list and a DataLoader keep their last-batch flag."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from overdrive.data import ImageLoader
from overdrive.train import Trainer

N_IMAGES, BATCH, EPOCHS = 14, 2, 2  # 7 batches an epoch: not a multiple of accumulate=3


class _Preempted(Exception):
    pass


class _SavingTrainer(Trainer):
    """A trainer whose preemption handler runs after the ``stop_after``-th trained batch: it saves the trainer and the
    data's position, then ends the run (as a SIGTERM handler that checkpoints and exits)."""

    def __init__(self, *args: Any, data: Any = None, stop_after: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data, self.stop_after, self.trained, self.saved = data, stop_after, 0, None

    def train_step(self, batch: Any, end_of_epoch: bool = False) -> torch.Tensor:
        loss = super().train_step(batch, end_of_epoch=end_of_epoch)
        self.trained += 1
        if self.trained == self.stop_after:
            self.saved = copy.deepcopy({"trainer": self.state_dict(), "data": self.data.state_dict()})
            raise _Preempted
        return loss


def _images(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for i in range(N_IMAGES):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (10 + i % 3, 12, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"c{i % 2}" / f"{i:02d}.{'png' if i % 2 else 'jpg'}")
    return root


def _trainer(seen: list[torch.Tensor], accumulate: int, data: Any = None, stop_after: int | None = None) -> _SavingTrainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 2))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(out.detach().clone())
        return nn.functional.cross_entropy(out, y)

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return _SavingTrainer(model, opt, loss_fn=loss_fn, accumulate=accumulate, progress=False, data=data,
                          stop_after=stop_after)


def _loader(root: Path) -> ImageLoader:
    return ImageLoader(root, batch_size=BATCH, size=8, seed=3, num_workers=0, pipeline="cpu")


@pytest.mark.parametrize("accumulate", [1, 3])
# epoch 0 mid-accumulation and at a step boundary before its partial one; epoch 1 at a boundary and mid-accumulation;
# after the last batch of epoch 0 and of epoch 1 (the loader's state at the epoch's end: the resumed fit finishes that
# epoch, its partial accumulation stepped, and goes on with the next; before, it refused "yielded no batch")
@pytest.mark.parametrize("stop_after", [2, 6, 7, 10, 11, 14])
def test_image_loader_state_taken_inside_fit_resumes_after_the_trained_batches(tmp_path: Path, accumulate: int,
                                                                                stop_after: int) -> None:
    root = _images(tmp_path)
    whole_seen: list[torch.Tensor] = []
    whole = _trainer(whole_seen, accumulate)
    whole.fit(_loader(root), epochs=EPOCHS)

    first_seen: list[torch.Tensor] = []
    loader = _loader(root)
    first = _trainer(first_seen, accumulate, data=loader, stop_after=stop_after)
    with pytest.raises(_Preempted):
        first.fit(loader, epochs=EPOCHS)
    assert first.saved["data"]["batches_taken"] == (stop_after - 1) % len(loader) + 1  # the batches trained, not one more

    resumed_seen: list[torch.Tensor] = []
    loader2 = _loader(root)
    resumed = _trainer(resumed_seen, accumulate)
    resumed.load_state_dict(first.saved["trainer"])
    loader2.load_state_dict(first.saved["data"])
    result = resumed.fit(loader2, max_epochs=EPOCHS)
    assert [e.epoch for e in result.history] == list(range((stop_after - 1) // len(loader2), EPOCHS))

    # the resumed run's batches are the uninterrupted run's remaining ones (the outputs: same images, crops, weights)
    assert len(first_seen) + len(resumed_seen) == len(whole_seen) == EPOCHS * len(loader2)
    for a, b in zip(first_seen + resumed_seen, whole_seen):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert resumed.step_count == whole.step_count


def _reference(data: list[tuple[torch.Tensor, torch.Tensor]], accumulate: int) -> nn.Module:
    """The hand-written loop fit stands for: step every ``accumulate`` micro-batches and on the epoch's last one, on
    the mean gradient of the accumulation's micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(EPOCHS):
        for start in range(0, len(data), accumulate):
            group = data[start:start + accumulate]
            for x, y in group:
                (nn.functional.cross_entropy(model(x), y) / len(group)).backward()
            opt.step()
            opt.zero_grad()
    return model


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("kind", ["list", "dataloader"])
def test_a_list_and_a_dataloader_still_step_the_epochs_last_partial_accumulation(accumulate: int, kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(N_IMAGES, 3, 8, 8, generator=g), torch.randint(0, 2, (N_IMAGES,), generator=g)
    pairs = [(xs[i:i + BATCH], ys[i:i + BATCH]) for i in range(0, N_IMAGES, BATCH)]
    data = pairs if kind == "list" else DataLoader(TensorDataset(xs, ys), batch_size=BATCH)
    trainer = _trainer([], accumulate)
    trainer.fit(data, epochs=EPOCHS)
    assert trainer.step_count == EPOCHS * -(-len(pairs) // accumulate)
    for a, b in zip(trainer.model.parameters(), _reference(pairs, accumulate).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
