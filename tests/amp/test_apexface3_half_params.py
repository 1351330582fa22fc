"""apex.optimizers on fp16/bf16 parameters without amp (``model.half()`` with the optimizer on the half weights, as
fairseq's memory-efficient fp16 runs them): apex's kernels did the math in fp32, so an element whose gradient and
moments are zero (an unused embedding row) stays finite, and FusedLAMB keeps its moments fp32 through a
checkpoint round trip. References are float64 updates written out here."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive.apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB


def _half_param() -> nn.Parameter:
    g = torch.Generator().manual_seed(0)
    return nn.Parameter(torch.randn(64, generator=g).half())


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().double()


def _grads(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        grad = torch.randn(64, generator=g)
        grad[:8] = 0  # rows no batch touched: zero gradient, zero moments
        out.append(grad.half())
    return out


def test_fused_adam_without_bias_correction_steps_half_params_in_fp32() -> None:
    w = _half_param()
    ref = w.detach().double()
    m, v = torch.zeros_like(ref), torch.zeros_like(ref)
    opt = FusedAdam([w], lr=1e-2, bias_correction=False, weight_decay=0.01)
    for grad in _grads(4):
        w.grad = grad
        opt.step()
        g = grad.double()
        ref = ref * (1 - 1e-2 * 0.01)
        m = _fp16(0.9 * m + 0.1 * g)  # apex's kernel: fp32 math, the state stored in the parameter's dtype
        v = _fp16(0.999 * v + 0.001 * g * g)
        ref = _fp16(ref - 1e-2 * m / (v.sqrt() + 1e-8))
    assert torch.isfinite(w).all(), "0/0 in fp16 (eps=1e-8 rounds to 0 there)"
    torch.testing.assert_close(w.detach().double(), ref, rtol=1e-3, atol=1e-3)  # an fp16 ulp
    assert opt.state[w]["exp_avg"].dtype == torch.float16  # torch's layout: state in the parameter's dtype


def test_fused_adagrad_steps_half_params_in_fp32() -> None:
    w = _half_param()
    ref = w.detach().double()
    total = torch.zeros_like(ref)
    opt = FusedAdagrad([w], lr=1e-2, weight_decay=0.0)
    for grad in _grads(4):
        w.grad = grad
        opt.step()
        g = grad.double()
        total = _fp16(total + g * g)
        ref = _fp16(ref - 1e-2 * g / (total.sqrt() + 1e-10))
    assert torch.isfinite(w).all(), "0/0 in fp16 (eps=1e-10 rounds to 0 there)"
    torch.testing.assert_close(w.detach().double(), ref, rtol=1e-3, atol=1e-3)  # an fp16 ulp
    assert int(opt.state[w]["step"]) == 4 and opt.state[w]["sum"].dtype == torch.float16


def test_fused_adagrad_half_params_skip_a_gradscaler_inf_step() -> None:
    w = _half_param()
    before = w.detach().clone()
    opt = FusedAdagrad([w], lr=1e-2)
    w.grad = _grads(1)[0]
    opt.found_inf = torch.ones(())  # what torch's GradScaler sets on a fused optimizer when the step overflowed
    opt.step()
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_lamb_resume_keeps_fp32_moments_and_the_trajectory(dtype: torch.dtype) -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(dtype)

    def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for i in steps:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(dtype)
            opt.zero_grad()
            m(x).float().square().mean().backward()
            opt.step()

    whole = model()
    train(whole, FusedLAMB(whole.parameters(), lr=1e-2), range(6))
    first = model()
    opt = FusedLAMB(first.parameters(), lr=1e-2)
    train(first, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = model()
    resumed.load_state_dict(ckpt["model"])
    opt = FusedLAMB(resumed.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["optimizer"])
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.float32}  # torch would cast them to `dtype`
    train(resumed, opt, range(3, 6))
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)
