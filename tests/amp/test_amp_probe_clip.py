"""Gradient clipping in the native API, checked against torch.amp.GradScaler + torch.nn.utils.clip_grad_norm_.

``MixedPrecision.clip_grad_norm_`` must clip every gradient the next step applies: O2 half gradients that a plain
``loss.backward()`` left on the model (bf16 needs no loss scale) and gradients a delayed ``scale_loss`` left scaled.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive import amp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _o2_step(backward: str, max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """One O2 bf16 SGD step with clipping; ``backward`` is how the gradients were made."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    if backward == "plain":
        loss.backward()  # bf16 needs no loss scale: a plain backward is supported at O2
    else:
        mp.backward(loss)
    norm = mp.clip_grad_norm_(max_norm)
    assert mp.step()
    return norm.item(), [q.detach().clone() for q in mp.master_params()]


def test_o2_clip_after_plain_backward_clips_the_half_gradients() -> None:
    """Before the fix the half model's gradients were not yet on the fp32 masters when clipping ran: only the
    LayerNorm's (fp32) gradients were clipped, the norm came out 0.15 instead of 0.80 and the step applied the
    Linear layers' gradients unclipped."""
    ref_norm, ref = _o2_step("scale_loss", 0.01)
    norm, got = _o2_step("plain", 0.01)
    assert norm == pytest.approx(ref_norm, rel=0, abs=0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ref_norm > 0.5  # clipping to 0.01 is active


def _accumulate(delay_last: bool) -> list[torch.Tensor]:
    """Two micro-batches under a static loss scale of 1024, clipped, one SGD step at O1 (bf16)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale=1024.0))
    g = torch.Generator().manual_seed(2)
    for k in range(2):
        loss = model(torch.randn(16, 8, generator=g)).float().square().mean() / 2
        with mp.scale_loss(loss, delay_unscale=(k == 0 or delay_last)) as scaled:
            scaled.backward()
    mp.clip_grad_norm_(0.05)
    assert mp.step()
    return [q.detach().clone() for q in model.parameters()]


def test_clip_unscales_gradients_a_delayed_scale_loss_left_scaled() -> None:
    """Clipping after ``delay_unscale=True`` on every micro-batch (gradients still multiplied by 1024) clipped the
    scaled gradients, which the step then divided by 1024 again: the update came out 1024x too small."""
    ref = _accumulate(delay_last=False)
    got = _accumulate(delay_last=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_o1_dynamic_loop_with_clipping_matches_gradscaler(norm_type: float) -> None:
    """An O1 bf16 loop with a dynamic scale, clipping and an inf loss at step 2 gives torch's GradScaler loop's
    scales, norms and weights exactly (power-of-two scales, the same autocast ops)."""
    policy = amp.Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic", init_scale=16.0,
                        growth_interval=2)
    m1, m2 = _model(), _model()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    mp = amp.prepare(m1, o1, policy)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        if step == 2:
            y[0, 0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
            mp.backward((m1(x).float() - y).square().mean())
            n1 = mp.clip_grad_norm_(0.5, norm_type=norm_type)
            took = mp.step()
            mp.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m2(x)
        scaler.scale((out.float() - y).square().mean()).backward()
        scaler.unscale_(o2)
        n2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.5, norm_type=norm_type)
        scaler.step(o2)
        scaler.update()
        o2.zero_grad()
        assert took is (step != 2)
        assert mp.loss_scale == scaler.get_scale()
        if step != 2:
            assert n1.item() == n2.item()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
