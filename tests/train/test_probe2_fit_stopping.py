"""fit's stopping and resuming: EarlyStopping counts as Keras / Lightning do, ``on_epoch_end`` returning True stops
fit, ``max_epochs`` reaches the same total from any resume point, and a mid-epoch checkpoint resumed through fit
over a ResumableSampler finishes the epoch as the uninterrupted run did (bit for bit on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.distributed import ResumableSampler
from overdrive.train import EarlyStopping, Trainer, load_checkpoint, save_checkpoint


def _target_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss that is the batch's target value (zero gradient): each epoch's loss is what the data says."""
    return out.sum() * 0.0 + y.float().mean()


class _EpochValues:
    """Two batches per epoch whose loss (under ``_target_loss``) is ``values[epoch]``; fit calls set_epoch."""

    def __init__(self, values: list[float]) -> None:
        self.values, self.epoch = values, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 2

    def __iter__(self):  # type: ignore[no-untyped-def]
        v = self.values[self.epoch]
        return iter([(torch.ones(2, 3), torch.full((2,), v)) for _ in range(2)])


def _trainer(lr: float = 0.0) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), loss_fn=_target_loss, progress=False)


@pytest.mark.parametrize(("values", "patience", "min_delta", "mode", "stop_at"), [
    # reference: Keras' EarlyStopping (wait += 1; reset on an improvement beyond min_delta; stop at wait >= patience)
    ([1.0, 0.8, 0.85, 0.81, 0.5], 2, 0.0, "min", 3),
    ([1.0, 0.95, 0.9, 0.85], 1, 0.1, "min", 1),        # each step improves by 0.05 < min_delta
    ([1.0, 0.9, 0.8, 0.7], 0, 0.0, "min", None),       # always improving: never stops
    ([1.0, 1.0], 0, 0.0, "min", 1),                    # patience 0: the first flat epoch stops
    ([0.5, 0.6, 0.6, 0.6], 2, 0.0, "max", 3),
])
def test_early_stopping_counts_as_keras(values: list[float], patience: int, min_delta: float, mode: str,
                                        stop_at: int | None) -> None:
    es = EarlyStopping(monitor="loss", patience=patience, min_delta=min_delta, mode=mode)
    got = next((i for i, v in enumerate(values) if es.step(v)), None)
    assert got == stop_at


def test_early_stopping_validates_its_arguments() -> None:
    with pytest.raises(UsageError, match="monitor one of"):
        EarlyStopping(monitor="val_loss")
    with pytest.raises(UsageError, match="patience"):
        EarlyStopping(patience=-1)
    with pytest.raises(UsageError, match="min_delta"):
        EarlyStopping(min_delta=float("nan"))
    assert EarlyStopping(monitor="eval_accuracy").mode == "max" and EarlyStopping().mode == "min"


def test_fit_stops_early_on_the_monitored_loss() -> None:
    t = _trainer()
    es = EarlyStopping(monitor="loss", patience=2)
    result = t.fit(_EpochValues([3.0, 2.0, 2.5, 2.0, 1.0, 0.5]), max_epochs=6, early_stopping=es)
    assert [round(s.loss, 6) for s in result.history] == [3.0, 2.0, 2.5, 2.0]
    assert result.stopped_epoch == 3 and t.epoch == 4
    assert es.best == 2.0 and es.best_epoch == 1


def test_fit_stops_when_on_epoch_end_returns_true() -> None:
    t = _trainer()
    result = t.fit(_EpochValues([1.0] * 5), epochs=5, on_epoch_end=lambda s: s.epoch == 1)
    assert len(result.history) == 2 and result.stopped_epoch == 1
    # a callback returning something else truthy (list.append's None, a dict) does not stop
    result = t.fit(_EpochValues([1.0] * 5), epochs=2, on_epoch_end=lambda s: {"epoch": s.epoch})
    assert len(result.history) == 2 and result.stopped_epoch is None


def test_eval_monitor_without_eval_data_fails_before_training() -> None:
    t = _trainer()
    with pytest.raises(UsageError, match="needs eval_data"):
        t.fit(_EpochValues([1.0]), epochs=1, early_stopping=EarlyStopping(monitor="eval_loss"))
    assert t.epoch == 0


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]


def _ce_trainer() -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), progress=False)


def test_max_epochs_after_a_resume_reaches_the_same_total(tmp_path: Path) -> None:
    data = _data()
    whole = _ce_trainer()
    whole.fit(data, epochs=5)
    first = _ce_trainer()
    first.fit(data, epochs=2)
    save_checkpoint(tmp_path / "c.pt", first)
    resumed = _ce_trainer()
    load_checkpoint(tmp_path / "c.pt", resumed)
    result = resumed.fit(data, max_epochs=5)  # Lightning's max_epochs, Keras' epochs with initial_epoch=2
    assert [s.epoch for s in result.history] == [2, 3, 4] and resumed.epoch == 5
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    done = resumed.fit(data, max_epochs=5)  # already there: nothing to run
    assert done.history == [] and resumed.epoch == 5
    with pytest.raises(UsageError, match="ran no epoch"):
        done.final_loss
    with pytest.raises(UsageError, match="give one of them"):
        resumed.fit(data, epochs=1, max_epochs=6)
    with pytest.raises(UsageError, match="give one of them"):
        resumed.fit(data)


def test_mid_epoch_checkpoint_resumes_through_fit_with_a_resumable_sampler(tmp_path: Path) -> None:
    ds = torch.utils.data.TensorDataset(torch.randn(12, 3, generator=torch.Generator().manual_seed(2)),
                                        torch.randint(0, 2, (12,), generator=torch.Generator().manual_seed(3)))

    def loader() -> tuple[ResumableSampler, torch.utils.data.DataLoader]:
        s = ResumableSampler(12, batch_size=2, seed=5)
        return s, torch.utils.data.DataLoader(ds, batch_size=2, sampler=s)

    _, whole_loader = loader()
    whole = _ce_trainer()
    whole.fit(whole_loader, epochs=2)

    sampler, dl = loader()
    first = _ce_trainer()
    for i, batch in enumerate(dl):  # a hand-written loop, checkpointed after 2 of the epoch's 6 steps
        first.train_step(batch)
        sampler.advance()
        if i == 1:
            break
    save_checkpoint(tmp_path / "mid.pt", first, extra={"sampler": sampler.state_dict()})

    sampler2, dl2 = loader()
    resumed = _ce_trainer()
    extra = load_checkpoint(tmp_path / "mid.pt", resumed)
    sampler2.load_state_dict(extra["sampler"])
    result = resumed.fit(dl2, max_epochs=2)
    assert [s.samples for s in result.history] == [8, 12]  # the rest of epoch 0, then a whole epoch 1
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
