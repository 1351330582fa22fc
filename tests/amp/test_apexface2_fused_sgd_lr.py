"""apex.optimizers.FusedSGD's lr has no default (apex's signature: ``lr=required``): leaving it out is an error
that says what to pass, while param groups that each name their lr work, as in apex."""

from __future__ import annotations

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.apex.optimizers import FusedSGD


def test_missing_lr_is_refused_with_the_fix() -> None:
    with pytest.raises(UsageError, match=r"pass lr=\.\.\."):
        FusedSGD(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(UsageError, match="'lr' in every param group"):
        FusedSGD([{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.1},
                  {"params": [torch.nn.Parameter(torch.ones(2))]}])


def test_per_group_lrs_without_a_default_step_as_sgd() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = FusedSGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.5}], momentum=0.9)
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    opt.step()
    torch.testing.assert_close(a.detach(), torch.full((2,), 0.9), rtol=0, atol=1e-7)
    torch.testing.assert_close(b.detach(), torch.full((2,), 0.5), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
