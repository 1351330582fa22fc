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
    _train(model, opt, opt_level, [torch.randn(4, 8, generator=g) for _ in range(steps)])
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, opt_level: str | None, batches: list[torch.Tensor]) -> None:
    """One step per batch on the loss mean(model(x)^2): plain backward without amp, amp.scale_loss with it."""
    for x in batches:
        loss = model(x).float().pow(2).mean()
        if opt_level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()


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


def _resume(opt_level: str | None, first: int = 2, then: int = 2) -> list[torch.Tensor]:
    """Hugging Face's resume (run_glue/run_squad, Trainer v3): fp32 training for ``first`` steps, the optimizer state
    saved; a new process builds the model, loads the weights and ``optimizer.pt``, *then* calls amp.initialize and
    trains ``then`` more steps. Returns the weights the optimizer holds."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=g) for _ in range(first + then)]
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for x in batches[:first]:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model.load_state_dict(saved_model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    opt.load_state_dict(saved_opt)
    if opt_level is not None:
        model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    _train(model, opt, opt_level, batches[first:])
    for st in opt.state.values():  # the loaded moments were used and kept counting
        assert float(st["step"]) == first + then
    return _weights(opt)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_optimizer_state_loaded_before_initialize_is_kept(opt_level: str) -> None:
    """amp.initialize used to refuse an optimizer with state ("already has state"). The reference is the same resume
    in fp32 without amp: O0 equal, O1/O2 within the bf16 forward's rounding. Without the loaded moments (a fresh
    AdamW) the weights differ from it by far more than that tolerance."""
    ref = _resume(None)
    tol = 0 if opt_level == "O0" else 2e-2
    for a, b in zip(_resume(opt_level), ref):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_o2_keeps_loaded_state_in_fp32_on_the_masters() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    moments = {id(q): st["exp_avg"].clone() for q, st in opt.state.items()}
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(opt))
    assert model.weight.dtype == torch.bfloat16 and all(q.dtype == torch.float32 for q in masters)
    for q in masters:  # the state is keyed to the masters, in fp32, unchanged
        assert opt.state[q]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(opt.state[q]["exp_avg"], moments[id(q)], atol=0, rtol=0)
