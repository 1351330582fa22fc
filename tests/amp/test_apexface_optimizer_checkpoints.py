"""apex.optimizers' checkpoints and step counts: a FusedAdam / FusedAdagrad / FusedLAMB checkpoint written by apex
(one ``step`` per param group, none per parameter) resumes here as it would have in apex, and FusedLAMB counts
steps per group as apex's kernel did (bias correction of a parameter that had no gradient for a while, global
clipping by the constructor's ``max_grad_norm``), against a float64 LAMB written out here."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, n: int) -> None:
    for i in range(start, start + n):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _as_apex(state_dict: dict, keep: tuple[str, ...], group_step: bool = True) -> dict:
    """The same checkpoint in apex's layout: per-parameter moments only, the step count in each group."""
    sd = copy.deepcopy(state_dict)
    steps = {i: int(s["step"]) for i, s in sd["state"].items()}
    sd["state"] = {i: {k: v for k, v in s.items() if k in keep} for i, s in sd["state"].items()}
    if group_step:
        for g in sd["param_groups"]:
            g["step"] = max(steps[i] for i in g["params"])
    return sd


ADAM_CASES = [
    (FusedAdam, {"lr": 1e-2, "weight_decay": 0.05}, ("exp_avg", "exp_avg_sq"), True),
    (FusedAdam, {"lr": 1e-2, "weight_decay": 0.05, "adam_w_mode": False}, ("exp_avg", "exp_avg_sq"), True),
    (FusedAdam, {"lr": 1e-2, "bias_correction": False}, ("exp_avg", "exp_avg_sq"), True),
    # apex's FusedAdagrad kept no step count at all
    (FusedAdagrad, {"lr": 1e-1, "weight_decay": 0.05}, ("sum",), False),
]


@pytest.mark.parametrize(("cls", "kw", "keep", "group_step"), ADAM_CASES)
def test_apex_layout_checkpoint_resumes_like_an_uninterrupted_run(cls, kw, keep, group_step) -> None:  # noqa: ANN001
    """torch's load_state_dict raised ``KeyError: 'step'`` on apex's checkpoints. Reference: the same optimizer
    run 5 steps without interruption; resumed after 3 from apex's layout it must match to fp32 rounding."""
    ref_model = _model()
    ref_opt = cls(ref_model.parameters(), **kw)
    _steps(ref_model, ref_opt, 0, 3)
    saved_model, saved = copy.deepcopy(ref_model.state_dict()), _as_apex(ref_opt.state_dict(), keep, group_step)
    _steps(ref_model, ref_opt, 3, 2)

    model = _model()
    model.load_state_dict(saved_model)
    opt = cls(model.parameters(), **kw)
    opt.load_state_dict(saved)
    _steps(model, opt, 3, 2)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_fused_adam_refuses_a_checkpoint_without_any_step_count() -> None:
    model = _model()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    _steps(model, opt, 0, 1)
    sd = _as_apex(opt.state_dict(), ("exp_avg", "exp_avg_sq"), group_step=False)
    with pytest.raises(UsageError, match="no 'step'"):
        FusedAdam(model.parameters(), lr=1e-2).load_state_dict(sd)


def _lamb64(w: list[torch.Tensor], grads: list[list[torch.Tensor | None]], lr: float, wd: float,
            max_norm: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6) -> list[torch.Tensor]:
    """apex's FusedLAMB in float64: one step count ``t`` per call, a global clip over the gradients present,
    trust ratio with weight decay."""
    w = [x.double().clone() for x in w]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, gs in enumerate(grads, start=1):
        present = [g.double() for g in gs if g is not None]
        norm = torch.sqrt(sum((g * g).sum() for g in present))
        div = norm / max_norm if norm > max_norm else 1.0
        for i, g in enumerate(gs):
            if g is None:
                continue
            g = g.double() / div
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps) + wd * w[i]
            r = w[i].norm() / u.norm() if w[i].norm() > 0 and u.norm() > 0 else 1.0
            w[i] = w[i] - lr * r * u
    return w


def test_fused_lamb_counts_steps_per_group_as_apex() -> None:
    """A parameter without a gradient for its first 2 steps (a head trained later, an unused pooler) is bias-
    corrected with its group's count, 3 at its first update, as apex's kernel did; a group's own max_grad_norm
    is ignored for the constructor's, as in apex. Reference: float64 LAMB, fp32 arithmetic within 1e-6."""
    g = torch.Generator().manual_seed(0)
    a = nn.Parameter(torch.randn(4, 4, generator=g))
    b = nn.Parameter(torch.randn(4, generator=g))
    start = [a.detach().clone(), b.detach().clone()]
    opt = FusedLAMB([{"params": [a, b], "max_grad_norm": 100.0}], lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    grads = []
    for i in range(5):
        ga = torch.randn(4, 4, generator=g) * 3  # the global norm exceeds 1: the steps clip
        gb = torch.randn(4, generator=g) if i >= 2 else None
        a.grad, b.grad = ga.clone(), None if gb is None else gb.clone()
        opt.step()
        grads.append([ga, gb])
    ref = _lamb64(start, grads, lr=1e-2, wd=0.01, max_norm=1.0)
    torch.testing.assert_close(a.detach().double(), ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(b.detach().double(), ref[1], rtol=0, atol=1e-6)
    assert opt.param_groups[0]["step"] == 5 and "step" not in opt.state[b]


@pytest.mark.parametrize("layout", ["apex", "per_parameter"])
def test_fused_lamb_resumes_from_apex_and_per_parameter_checkpoints(layout: str) -> None:
    """apex's checkpoint (step in the group) and one with a step per parameter state (this class's earlier
    layout) both resume like an uninterrupted run."""
    ref_model = _model()
    ref_opt = FusedLAMB(ref_model.parameters(), lr=1e-2)
    _steps(ref_model, ref_opt, 0, 3)
    saved_model, sd = copy.deepcopy(ref_model.state_dict()), copy.deepcopy(ref_opt.state_dict())
    if layout == "per_parameter":
        steps = [g.pop("step") for g in sd["param_groups"]]
        for g, step in zip(sd["param_groups"], steps):
            for i in g["params"]:
                sd["state"][i]["step"] = step
    _steps(ref_model, ref_opt, 3, 2)

    model = _model()
    model.load_state_dict(saved_model)
    opt = FusedLAMB(model.parameters(), lr=1e-2)
    opt.load_state_dict(sd)
    _steps(model, opt, 3, 2)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert opt.param_groups[0]["step"] == 5
