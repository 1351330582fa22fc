"""``Policy(growth_factor=, backoff_factor=)``: torch.amp.GradScaler's two factors, checked against GradScaler."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from overdrive import amp
from overdrive._utils.errors import UsageError


def test_custom_factors_follow_gradscaler() -> None:
    """A loop ported from ``GradScaler(init_scale=64, growth_factor=4, backoff_factor=0.25, growth_interval=1)``
    keeps GradScaler's scale at every step (inf losses at steps 2 and 3) and its weights exactly."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

    m1, m2 = model(), model()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    mp = amp.prepare(m1, o1, amp.Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic", init_scale=64.0,
                                        growth_factor=4.0, backoff_factor=0.25, growth_interval=1))
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1)
    g = torch.Generator().manual_seed(1)
    scales = []
    for step in range(6):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        if step in (2, 3):
            y[0, 0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mp.backward((m1(x).float() - y).square().mean())
            mp.step()
            mp.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m2(x)
        scaler.scale((out.float() - y).square().mean()).backward()
        scaler.step(o2)
        scaler.update()
        o2.zero_grad()
        assert mp.loss_scale == scaler.get_scale(), step
        scales.append(mp.loss_scale)
    assert scales == [256.0, 1024.0, 256.0, 64.0, 256.0, 1024.0]
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_factors_round_trip_and_stay_out_of_default_json() -> None:
    p = amp.Policy(opt_level="O1", growth_factor=1.5, backoff_factor=0.75)
    assert amp.Policy.from_json(p.to_json()) == p
    default = json.loads(amp.Policy(opt_level="O1").to_json())
    assert "growth_factor" not in default and "backoff_factor" not in default  # earlier versions read it


@pytest.mark.parametrize("field, value", [("growth_factor", 0.5), ("growth_factor", float("nan")),
                                          ("backoff_factor", 1.0), ("backoff_factor", 0), ("backoff_factor", True)])
def test_bad_factor_is_named(field: str, value: float) -> None:
    with pytest.raises(UsageError, match=f"{field}=.* must be a number"):
        amp.Policy(opt_level="O1", **{field: value})
