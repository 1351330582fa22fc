"""Trainer's objects (model, optimizer) are checked at construction: an optimizer that steps none of the model's
parameters trained nothing, with no word (the loss stayed where it was for every epoch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive import UsageError
from overdrive.amp import Policy
from overdrive.train import Trainer


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("policy", ["O0", Policy(opt_level="O2", dtype=torch.bfloat16)])
def test_an_optimizer_of_another_model_is_refused(policy: object) -> None:
    model, other = nn.Linear(4, 3), nn.Linear(4, 3)
    with pytest.raises(UsageError, match=r"optimizer holds 2 parameter\(s\), none of them the model's \(2\); build it on "
                                         r"this model's parameters, e.g. torch.optim.SGD\(model.parameters\(\)"):
        Trainer(model, torch.optim.SGD(other.parameters(), lr=0.1), policy=policy, progress=False)


def test_no_optimizer_is_refused() -> None:
    with pytest.raises(UsageError, match=r"optimizer=None is not a torch.optim.Optimizer; pass one built on"):
        Trainer(nn.Linear(4, 3), None, progress=False)  # type: ignore[arg-type]


def test_no_model_is_refused() -> None:
    opt = torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"model=NoneType is not a torch.nn.Module"):
        Trainer(None, opt, progress=False)  # type: ignore[arg-type]


def test_an_optimizer_on_part_of_the_model_still_trains_that_part() -> None:
    # fine-tuning a head: the check asks for one of the model's parameters, not all of them
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    body = model[0].weight.detach().clone()
    head = model[1].weight.detach().clone()
    t = Trainer(model, torch.optim.SGD(model[1].parameters(), lr=0.1), progress=False)
    t.train_step(_batch())
    assert torch.equal(model[0].weight, body) and not torch.equal(model[1].weight, head)


def test_a_one_shot_iterator_over_several_epochs_is_refused_before_training() -> None:
    # a generator trained epoch 0, then epoch 1 found it empty: "yielded no batch; check the dataset and batch
    # size", and epoch 0's result was lost
    import pytest
    import torch
    from torch import nn

    from overdrive._utils.errors import UsageError
    from overdrive.train import Trainer

    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    before = m.weight.detach().clone()
    t = Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), progress=False)
    gen = ((torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(2))
    with pytest.raises(UsageError, match=r"train_data is a one-shot iterator \(generator\), which epochs=2 would find "
                                         r"empty after the first epoch"):
        t.fit(gen, epochs=2)
    assert torch.equal(m.weight, before)  # refused before any step
    assert len(t.fit(gen, epochs=1).history) == 1  # one epoch of it is fine
