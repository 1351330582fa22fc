"""MixedPrecision.defer_checks: the inf/NaN verdicts read a step late, a bad step skipped on the device.

Reference: the same run with the checks read at once (the default). Every weight, optimizer state, loss scale and
skip count must match exactly (same kernels, same order), also across an injected overflow; the warning names the
step it is about, one step later. On the CPU the flags are read from CPU tensors (no event): the logic is the one a
CUDA run uses, without the pinned copy.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive.amp import Policy, prepare

INF = float("inf")


def _run(defer: bool, policy: Policy, opt_cls: type = torch.optim.AdamW, steps: int = 6,
         bad: dict[int, str] | None = None, accumulate: int = 1, **opt_kw: object) -> tuple[object, list[str]]:
    """``bad``: backward -> "grad" (an inf in one gradient: the loss is finite) or "loss" (an inf input); a step
    every ``accumulate`` backwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = opt_cls(model.parameters(), lr=1e-2, fused=True, **opt_kw)
    mp = prepare(model, opt, policy)
    assert mp.defer_checks(defer) is defer
    g = torch.Generator().manual_seed(1)
    poison = [False]

    def hook(grad: torch.Tensor) -> torch.Tensor:  # an inf in one gradient, during the backward (the loss is finite)
        if poison[0]:
            grad = grad.clone()
            grad[0, 0] = INF
        return grad

    model[0].weight.register_hook(hook)
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(steps):
            x = torch.randn(8, 6, generator=g)
            if (bad or {}).get(i) == "loss":
                x[0, 0] = INF
            poison[0] = (bad or {}).get(i) == "grad"
            with mp.autocast():
                loss = model(x.to(next(model.parameters()).dtype)).float().square().mean()
            mp.backward(loss)
            if (i + 1) % accumulate == 0:
                mp.step(number=i // accumulate, wait=not defer)
                mp.zero_grad()
        state = {
            "masters": [q.detach().clone() for q in mp.master_params()],
            "weights": [q.detach().clone() for q in model.parameters()],
            "opt": {k: v.clone() for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)},
            "scale": mp.loss_scale, "skipped": mp.skipped_steps, "steps": dict(mp.guard.steps),
        }
    caught = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    return state, caught


def _same(a: dict, b: dict) -> None:
    assert a["scale"] == b["scale"] and a["skipped"] == b["skipped"] and a["steps"] == b["steps"]
    for key in ("masters", "weights"):
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), key
    assert a["opt"].keys() == b["opt"].keys()


DYNAMIC = Policy(opt_level="O2", dtype=torch.bfloat16, loss_scale="dynamic", growth_interval=2)
STATIC = Policy(opt_level="O1", dtype=torch.bfloat16)


@pytest.mark.parametrize("policy", [DYNAMIC, STATIC, Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic")],
                         ids=["O2-dynamic", "O1-static", "O1-dynamic"])
@pytest.mark.parametrize("bad", [{}, {2: "grad"}, {3: "loss"}], ids=["clean", "grad-overflow", "inf-loss"])
def test_deferred_checks_train_exactly_as_the_immediate_ones(policy: Policy, bad: dict[int, str]) -> None:
    now, _ = _run(False, policy, bad=bad)
    later, _ = _run(True, policy, bad=bad)
    _same(now, later)
    assert later["skipped"] == len(bad)


@pytest.mark.parametrize("bad", [{2: "grad"}, {3: "grad"}, {4: "loss"}], ids=["first-micro", "second-micro", "loss"])
def test_deferred_checks_with_gradient_accumulation(bad: dict[int, str]) -> None:
    """An overflow in either micro-batch of an accumulation skips that step and backs off the scale the next
    micro-batch multiplies by, exactly as the immediate checks do."""
    now, _ = _run(False, DYNAMIC, bad=bad, steps=8, accumulate=2)
    later, _ = _run(True, DYNAMIC, bad=bad, steps=8, accumulate=2)
    _same(now, later)
    assert later["skipped"] == 1


def test_a_deferred_inf_loss_warns_a_step_late_naming_its_own_step() -> None:
    _, now = _run(False, STATIC, bad={3: "loss"})
    _, later = _run(True, STATIC, bad={3: "loss"})
    assert len(now) == len(later) == 1 and later[0].startswith("step 3: the loss is inf or NaN")
    assert now == later


def test_a_dynamic_overflow_backs_off_the_scale_for_the_next_backward() -> None:
    """The scale the next backward multiplies by is the backed-off one: read before that backward."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    mp = prepare(model, opt, Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic", init_scale=8.0))
    assert mp.defer_checks()
    w0 = model.weight.detach().clone()
    mp.backward(model(torch.full((1, 4), INF)).sum())  # an inf loss: the backward's flag is set
    assert mp.step(wait=False) is None  # no verdict read yet
    assert torch.equal(model.weight, w0)  # skipped on the device
    seen = []
    real = mp.scalers[0].unscale_and_check_

    def spy(grads: list[torch.Tensor]) -> torch.Tensor | None:
        seen.append(mp.scalers[0].scale)
        return real(grads)

    mp.scalers[0].unscale_and_check_ = spy  # type: ignore[method-assign]
    mp.zero_grad()
    mp.backward(model(torch.ones(1, 4)).sum())
    assert seen == [4.0] and mp.skipped_steps == 1
    mp.step()
    assert not torch.equal(model.weight, w0) and mp.skipped_steps == 1


def test_fused_sgd_with_momentum_checks_its_first_step_on_the_host() -> None:
    """torch's fused SGD makes its momentum buffers with empty_like at the first step and leaves them so when that
    step skips on the device: uninitialized momentum. That step is checked on the host, later ones on the device."""
    now, _ = _run(False, DYNAMIC, torch.optim.SGD, bad={0: "grad", 3: "grad"}, momentum=0.9)
    later, _ = _run(True, DYNAMIC, torch.optim.SGD, bad={0: "grad", 3: "grad"}, momentum=0.9)
    _same(now, later)
    assert all(torch.equal(now["opt"][k], later["opt"][k]) for k in now["opt"])
    assert later["skipped"] == 2


def test_defer_checks_is_refused_where_a_step_cannot_skip_itself() -> None:
    model = nn.Linear(4, 2)
    assert not prepare(model, torch.optim.AdamW(model.parameters()), STATIC).defer_checks()  # not fused
    m2 = nn.Linear(4, 2)
    assert not prepare(m2, torch.optim.AdamW(m2.parameters(), fused=True),
                       Policy(opt_level="O1", dtype=torch.bfloat16, on_nonfinite="raise")).defer_checks()
    m3, m4 = nn.Linear(4, 2), nn.Linear(4, 2)
    mp = prepare([m3, m4], [torch.optim.AdamW(m3.parameters(), fused=True),
                            torch.optim.AdamW(m4.parameters(), fused=True)], STATIC)
    assert not mp.defer_checks()


def test_pending_state_reports_a_deferred_overflow_and_a_resume_skips_that_step() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    mp = prepare(model, opt, Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic"))
    mp.defer_checks()
    mp.backward(model(torch.full((1, 4), INF)).sum())
    pending = mp.pending_state()
    assert pending["skip"] == [0]
    w0 = model.weight.detach().clone()
    mp.load_pending_state(pending)
    assert mp.step() is False and torch.equal(model.weight, w0) and mp.skipped_steps == 1


def test_consecutive_deferred_skips_stop_the_run_when_read() -> None:
    from overdrive import OverdriveError

    policy = Policy(opt_level="O1", dtype=torch.bfloat16, max_consecutive_skips=2)
    with pytest.raises(OverdriveError, match=r"2 optimizer steps in a row \(steps 1 to 2\)"):
        _run(True, policy, bad={1: "loss", 2: "loss"})
