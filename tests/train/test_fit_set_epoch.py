"""Trainer.fit calls set_epoch at the start of each epoch, as a torch loop calls sampler.set_epoch: before, an
ImageLoader or a DataLoader over a DistributedSampler gave every epoch the first one's order (and crops)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from overdrive.train import Trainer


class _Epochs:
    """An iterable that records set_epoch and yields a batch order that depends on the epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.epoch, self.calls = x, y, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        return iter([(self.x[order[i:i + 4]], self.y[order[i:i + 4]]) for i in range(0, len(order), 4)])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def test_fit_sets_each_epoch_and_equals_a_hand_written_loop() -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)
    data = _Epochs(x, y)
    m = _model()
    ref = copy.deepcopy(m)
    Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), progress=False).fit(data, epochs=3)
    assert data.calls == [0, 1, 2]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loop = _Epochs(x, y)
    for epoch in range(3):
        loop.set_epoch(epoch)
        for xb, yb in loop:
            opt.zero_grad()
            nn.functional.cross_entropy(ref(xb), yb).backward()
            opt.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_fit_sets_the_epoch_of_a_dataloaders_distributed_sampler() -> None:
    ds = TensorDataset(torch.randn(8, 5), torch.randint(0, 3, (8,)))
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    m = _model()
    t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), progress=False)
    t.fit(DataLoader(ds, batch_size=4, sampler=sampler), epochs=2)
    assert sampler.epoch == 1
    t.fit(DataLoader(ds, batch_size=4, sampler=sampler), epochs=1)  # the trainer's epoch counts on
    assert sampler.epoch == 2


class _BucketBatches(torch.utils.data.Sampler):
    """A batch sampler of its own (length-bucketing samplers are written so) whose batch order depends on the epoch."""

    def __init__(self, n: int, batch: int) -> None:
        self.n, self.batch, self.epoch = n, batch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        return iter([order[i:i + self.batch] for i in range(0, self.n, self.batch)])

    def __len__(self) -> int:
        return -(-self.n // self.batch)


class _StreamingShuffle(torch.utils.data.IterableDataset):
    """An iterable dataset whose shuffle is seeded by the epoch (a Hugging Face streaming dataset's ``set_epoch``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.epoch = x, y, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in torch.randperm(len(self.x), generator=torch.Generator().manual_seed(200 + self.epoch)).tolist():
            yield self.x[i], self.y[i]


def test_fit_sets_the_epoch_of_a_batch_sampler_and_of_an_iterable_dataset() -> None:
    """Before, only the DataLoader's sampler and its batch sampler's sampler were asked: a batch sampler of one's own
    and a streaming dataset kept epoch 0's order in every epoch. Each epoch's order now equals the hand-written
    loop's (``set_epoch`` on them, as accelerate's DataLoaderShard calls it)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)
    for make in (lambda: DataLoader(TensorDataset(x, y), batch_sampler=_BucketBatches(12, 4)),
                 lambda: DataLoader(_StreamingShuffle(x, y), batch_size=4)):
        seen: list[list[int]] = []

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            seen.append(target.tolist())
            return nn.functional.cross_entropy(out, target)

        m = _model()
        Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=loss_fn, progress=False).fit(make(), epochs=3)
        expected: list[list[int]] = []
        loop = make()
        for epoch in range(3):
            (loop.batch_sampler if isinstance(loop.batch_sampler, _BucketBatches) else loop.dataset).set_epoch(epoch)
            expected += [yb.tolist() for _, yb in loop]
        assert seen == expected
        assert seen[:3] != seen[3:6]  # the epochs' orders differ
