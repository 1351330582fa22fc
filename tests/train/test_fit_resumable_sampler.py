"""``fit`` over a DataLoader on a ResumableSampler advances the sampler after each batch, so a checkpoint taken while
fit runs (a preemption handler saving mid-epoch) resumes after exactly the batches already trained on: the resumed
run equals the uninterrupted one bit for bit on CPU and trains each sample of the epoch once. Before, the sampler's
position stayed at the epoch's start and the resumed run trained the interrupted epoch's first batches twice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from overdrive._utils.errors import UsageError
from overdrive.distributed import ResumableSampler
from overdrive.train import Trainer, load_checkpoint, save_checkpoint

N, BATCH = 24, 3  # 8 batches an epoch


class _Preempted(Exception):
    pass


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g))


def _trainer(seen: list[int] | None = None, stop_after: int | None = None, accumulate: int = 1) -> Trainer:
    """A trainer whose loss records each batch's targets in ``seen`` and, as a preemption signal would, interrupts
    the ``stop_after + 1``-th batch before anything of it is applied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    calls = 0

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        if stop_after is not None and calls == stop_after:
            raise _Preempted
        calls += 1
        if seen is not None:
            seen.extend(y.tolist())
        return nn.functional.cross_entropy(out, y)

    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn=loss_fn,
                   accumulate=accumulate, progress=False)


def _loader() -> tuple[ResumableSampler, DataLoader]:
    s = ResumableSampler(N, batch_size=BATCH, seed=7)
    return s, DataLoader(_dataset(), batch_size=BATCH, sampler=s)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("stop_after", [3, 10])  # mid epoch 0 (and mid-accumulation with 2); mid epoch 1
def test_a_checkpoint_taken_inside_fit_resumes_after_the_trained_batches(tmp_path: Path, accumulate: int,
                                                                          stop_after: int) -> None:
    whole_seen: list[int] = []
    _, dl = _loader()
    whole = _trainer(whole_seen, accumulate=accumulate)
    whole.fit(dl, epochs=2)

    first_seen: list[int] = []
    sampler, dl = _loader()
    first = _trainer(first_seen, stop_after=stop_after, accumulate=accumulate)
    with pytest.raises(_Preempted):
        first.fit(dl, epochs=2)
    save_checkpoint(tmp_path / "c.pt", first, extra={"sampler": sampler.state_dict()})
    assert sampler.state_dict()["consumed"] == (stop_after % (N // BATCH)) * BATCH

    resumed_seen: list[int] = []
    sampler2, dl2 = _loader()
    resumed = _trainer(resumed_seen, accumulate=accumulate)
    sampler2.load_state_dict(load_checkpoint(tmp_path / "c.pt", resumed)["sampler"])
    resumed.fit(dl2, max_epochs=2)
    assert first_seen + resumed_seen == whole_seen  # each sample of each epoch once, in the same order
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_loader_batch_size_other_than_the_samplers_is_refused() -> None:
    s = ResumableSampler(N, batch_size=BATCH, seed=7)
    with pytest.raises(UsageError, match=r"batch_size=4 differs from its ResumableSampler's batch_size=3"):
        _trainer().fit(DataLoader(_dataset(), batch_size=4, sampler=s), epochs=1)


def test_a_used_up_sampler_at_the_trainers_epoch_says_so() -> None:
    s, dl = _loader()
    _trainer().fit(dl, epochs=1)
    with pytest.raises(UsageError, match="no sample left in epoch 0"):
        _trainer().fit(dl, epochs=1)  # a fresh trainer (epoch 0) over the same, finished sampler


class _PreemptedEval:
    """Evaluation data whose ``preempt_at``-th pass is interrupted (a preemption arriving during an epoch's
    evaluation: the epoch's batches all trained, the sampler used up, ``trainer.epoch`` not yet counted on)."""

    def __init__(self, preempt_at: int | None = None) -> None:
        g = torch.Generator().manual_seed(5)
        self.batches = [(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g))]
        self.preempt_at, self.passes = preempt_at, 0

    def __iter__(self):
        self.passes += 1
        if self.passes == self.preempt_at:
            raise _Preempted
        return iter(self.batches)


@pytest.mark.parametrize("accumulate", [1, 3])  # 8 batches: with 3, the epoch ends on a partial accumulation
@pytest.mark.parametrize("preempt_at", [1, 2])  # during epoch 0's evaluation; during the last epoch's
def test_a_checkpoint_taken_at_the_epochs_end_resumes_with_the_next_epoch(tmp_path: Path, accumulate: int,
                                                                           preempt_at: int) -> None:
    whole_seen: list[int] = []
    _, dl = _loader()
    whole = _trainer(whole_seen, accumulate=accumulate)
    whole_result = whole.fit(dl, epochs=2, eval_data=_PreemptedEval())

    first_seen: list[int] = []
    sampler, dl = _loader()
    first = _trainer(first_seen, accumulate=accumulate)
    with pytest.raises(_Preempted):
        first.fit(dl, epochs=2, eval_data=_PreemptedEval(preempt_at))
    save_checkpoint(tmp_path / "c.pt", first, extra={"sampler": sampler.state_dict()})
    assert sampler.state_dict()["consumed"] == N and first.epoch == preempt_at - 1

    resumed_seen: list[int] = []
    sampler2, dl2 = _loader()
    resumed = _trainer(resumed_seen, accumulate=accumulate)
    sampler2.load_state_dict(load_checkpoint(tmp_path / "c.pt", resumed)["sampler"])
    result = resumed.fit(dl2, max_epochs=2, eval_data=_PreemptedEval())  # before: "no sample left in epoch 0"
    assert first_seen + resumed_seen == whole_seen  # the next epoch's samples, none twice
    assert resumed.epoch == 2 and resumed.step_count == whole.step_count
    # the resumed epoch trains nothing (no loss) and is evaluated as the uninterrupted run's was
    assert result.history[0].samples == 0 and result.history[0].eval_loss == whole_result.history[preempt_at - 1].eval_loss
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
