"""Optimizers that make their state when built (torch's Adagrad: ``step`` 0 and the accumulator) are not "stepped":
``amp.initialize`` refused them ("the optimizer already has state"), so an apex script with Adagrad failed at the
initialize call. Reference: the same steps by plain torch Adagrad in float32 (O0 exactly, O2's fp32 masters within
bf16 rounding of the forward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.apex import amp


def _run(opt_level: str | None, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1)
    if opt_level is not None:
        model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).float().pow(2).mean()
        if opt_level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _weights(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [q.detach().float() for g in opt.param_groups for q in g["params"]]


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_adagrad_is_accepted_and_steps(opt_level: str) -> None:
    _, ref = _run(None)
    _, got = _run(opt_level)
    tol = 0 if opt_level == "O0" else 5e-2  # O1-O3: bf16 forward on CPU
    for a, b in zip(_weights(got), _weights(ref)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    for q, st in got.state.items():  # the accumulator kept its initial value and took the steps
        assert float(st["step"]) == 3 and st["sum"].dtype == q.dtype and bool((st["sum"] >= 0.1 - 1e-3).all())


def test_a_stepped_optimizer_is_still_refused() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(UsageError, match="already has state"):
        amp.initialize(model, opt, opt_level="O1", verbosity=0)
    adagrad = torch.optim.Adagrad(nn.Linear(2, 2).parameters())
    next(iter(adagrad.state.values()))["step"].fill_(5.0)  # a loaded Adagrad checkpoint: it has stepped
    with pytest.raises(UsageError, match="already has state"):
        amp.initialize(nn.Linear(2, 2), adagrad, opt_level="O1", verbosity=0)
