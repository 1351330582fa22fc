"""Dynamic loss scaling has a floor and speaks up. Reference: apex's backoff (x0.5 per overflow) bounded
below by min_loss_scale (default 1.0). Without a floor, repeated overflows drove the scale to 5.8e-11 and,
at step 145, to "value cannot be converted to type float without overflow", with no warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from overdrive.amp import Policy, prepare
from overdrive.amp.scaler import LossScaler


def test_scale_floors_at_one_by_default() -> None:
    s = LossScaler(dynamic=True, init_scale=2.0**16, warn_after=10**9)
    for _ in range(300):
        s.update(found_inf=True)
    assert s.scale == 1.0 and s.overflows == 300
    s2 = LossScaler(dynamic=True, init_scale=2.0**16, min_scale=128.0, warn_after=10**9)
    for _ in range(40):
        s2.update(found_inf=True)
    assert s2.scale == 128.0
    assert LossScaler(dynamic=True, init_scale=0.25).min_scale == 0.25  # a user's lower start is kept


def test_warns_once_per_run_of_skips() -> None:
    s = LossScaler(dynamic=True, init_scale=4.0, warn_after=5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(12):
            s.update(found_inf=True)
        s.update(found_inf=False)  # a clean step ends the run
        for _ in range(4):
            s.update(found_inf=True)
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "5 optimizer steps in a row were skipped" in msgs[0]


def test_training_with_inf_gradients_keeps_a_finite_scale() -> None:
    """The reported case end to end: every loss is inf, under O1 with a dynamic scale; each step is skipped
    (the weights never change) and the scale stops at the floor. (By default the run now stops after 50
    skipped steps in a row, tests/amp/test_nonfinite.py; max_consecutive_skips=None lets it go on.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = prepare(model, opt, Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic",
                                    max_consecutive_skips=None))
    w0 = model.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="step 0: the loss is inf or NaN"):
        for _ in range(200):
            with mp.autocast():
                loss = model(torch.randn(8, 4)).float().sum() * float("inf")
            mp.backward(loss)
            assert mp.step() is False  # skipped, never applied
            mp.zero_grad()
    assert mp.loss_scale == 1.0 and torch.equal(model.weight, w0) and mp.skipped_steps == 200
