"""``overdrive.apex.fp16_utils``: FP16_Optimizer and the manual master-weight helpers, against a float64 replay of
the same gradients (tolerance: fp32 arithmetic), with static and dynamic loss scales."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive.apex.fp16_utils import (BN_convert_float, FP16_Module, FP16_Optimizer, master_params_to_model_params,
                                       model_grads_to_master_grads, network_to_half, prep_param_lists, tofp16)

HALVES = [torch.float16, torch.bfloat16]


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return BN_convert_float(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).to(dtype))


def _x(i: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(i)).to(dtype)


def _sgd_reference(start: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, momentum: float) -> list[torch.Tensor]:
    w = [p.double().clone() for p in start]
    buf: list[torch.Tensor | None] = [None] * len(w)
    for step in grads:
        for i, g in enumerate(step):
            buf[i] = g.double() if buf[i] is None else momentum * buf[i] + g.double()
            w[i] = w[i] - lr * buf[i]
    return w


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_optimizer_steps_fp32_masters_as_a_float64_replay(dtype: torch.dtype, dynamic: bool) -> None:
    model = _model(dtype)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               static_loss_scale=128.0, dynamic_loss_scale=dynamic,
                               dynamic_loss_args={"init_scale": 2.0**10} if dynamic else None)
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    start = [p.detach().clone() for p in masters]
    assert all(p.dtype == torch.float32 for p in masters)
    grads = []
    for i in range(3):
        optimizer.zero_grad()
        optimizer.backward(model(_x(i, dtype)).float().square().mean())
        grads.append([p.grad.detach().clone() for p in masters])  # unscaled fp32 gradients
        optimizer.step()
    for got, want in zip(masters, _sgd_reference(start, grads, 0.05, 0.9)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    half_params = [p for p in model.parameters() if p.dtype == dtype]
    for h, m in zip(half_params, optimizer.fp32_from_fp16_groups[0]):
        assert torch.equal(h, m.detach().to(dtype))  # the model follows the masters, rounded


def test_loss_scale_unscales_exactly() -> None:
    # one backward at loss scale 1 and one at 2**12: the same fp32 master gradients (powers of two scale exactly
    # unless fp16 under/overflows, which this small loss does not reach)
    runs = []
    for scale in (1.0, 2.0**12):
        model = _model(torch.float16)
        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=scale)
        optimizer.backward(model(_x(0, torch.float16)).float().mean())
        runs.append([p.grad for g in optimizer.param_groups for p in g["params"]])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-6)  # fp16 rounding of the scaled gradients


def test_dynamic_scale_skips_an_overflow_backs_off_and_grows() -> None:
    model = _model(torch.float16)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                               dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 2})
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in masters]
    hook = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    optimizer.backward(model(_x(0, torch.float16)).float().mean())
    hook.remove()
    assert optimizer.overflow and optimizer.clip_master_grads(1.0) == -1
    assert optimizer.step() is None and optimizer.loss_scale == 2.0**7 and optimizer.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, masters))
    for i in range(2):
        optimizer.zero_grad()
        optimizer.backward(model(_x(i, torch.float16)).float().mean())
        optimizer.step()
    assert optimizer.loss_scale == 2.0**8 and not all(torch.equal(a, b) for a, b in zip(before, masters))


def test_static_scale_overflow_is_skipped_with_a_warning() -> None:
    model = _model(torch.bfloat16)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0)
    optimizer.backward(model(_x(0, torch.bfloat16)).float().mean() * float("nan"))
    with pytest.warns(RuntimeWarning, match="static loss scale 8"):
        optimizer.step()
    assert optimizer.loss_scale == 8.0 and optimizer.skipped_steps == 1


@pytest.mark.parametrize("update_first", [False, True])
def test_backward_twice_accumulates_half_and_fp32_parameters_exactly(update_first: bool) -> None:
    # apex's docs call both forms valid; apex unscaled the fp32 parameters' gradients once per update, so the
    # second form left the first loss's fp32 gradients divided by the scale twice
    model = _model(torch.bfloat16)  # BatchNorm stays fp32: its grads are unscaled in backward, then accumulated
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0)
    optimizer.backward(model(_x(0, torch.bfloat16)).float().mean(), update_master_grads=update_first)
    optimizer.backward(model(_x(1, torch.bfloat16)).float().mean())
    model2 = _model(torch.bfloat16)  # built the same way; one loss, the sum of both
    ref = FP16_Optimizer(torch.optim.SGD(model2.parameters(), lr=0.1), static_loss_scale=64.0)
    ref.backward(model2(_x(0, torch.bfloat16)).float().mean() + model2(_x(1, torch.bfloat16)).float().mean())
    for a, b in zip(*([p.grad for g in o.param_groups for p in g["params"]] for o in (optimizer, ref))):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)  # bf16 gradient rounding of two sums vs one


def test_state_dict_round_trip_resumes_identically() -> None:
    def build() -> tuple[nn.Module, FP16_Optimizer]:
        model = _model(torch.bfloat16)
        return model, FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True)

    def train(model: nn.Module, optimizer: FP16_Optimizer, steps: range) -> None:
        for i in steps:
            optimizer.zero_grad()
            optimizer.backward(model(_x(i, torch.bfloat16)).float().square().mean())
            optimizer.clip_master_grads(1.0)
            optimizer.step()

    model, optimizer = build()
    train(model, optimizer, range(2))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    train(model, optimizer, range(2, 4))
    buf.seek(0)
    checkpoint = torch.load(buf)  # weights_only: plain tensors and numbers
    model2, optimizer2 = build()
    model2.load_state_dict(checkpoint["model"])
    optimizer2.load_state_dict(checkpoint["optimizer"])
    train(model2, optimizer2, range(2, 4))
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert optimizer.loss_scale == optimizer2.loss_scale


def test_closure_step_with_a_static_scale() -> None:
    model = _model(torch.bfloat16)
    optimizer = FP16_Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3), static_loss_scale=4.0)
    x = _x(0, torch.bfloat16)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).float().square().mean()
        optimizer.backward(loss)
        return loss

    first = closure().item()
    optimizer.step(closure)
    assert model(x).float().square().mean().item() < first
    with pytest.raises(TypeError, match="closure"):
        FP16_Optimizer(torch.optim.SGD(_model(torch.bfloat16).parameters(), lr=0.1), dynamic_loss_scale=True).step(closure)


def test_manual_master_params_recipe_and_network_to_half() -> None:
    net = network_to_half(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)))
    assert isinstance(net[0], tofp16) and net[1][0].weight.dtype == torch.bfloat16  # the CPU's half (amp's too)
    assert net[1][1].weight.dtype == torch.float32 and net(_x(0, torch.float32)).dtype == torch.bfloat16
    fp16 = network_to_half(nn.Linear(6, 3), dtype=torch.float16)
    assert fp16(_x(0, torch.float32)).dtype == torch.float16
    for flat in (False, True):
        model = nn.Linear(6, 3).half()
        model_params, master_params = prep_param_lists(model, flat_master=flat)
        model(_x(0, torch.float16)).float().sum().backward()
        model_grads_to_master_grads(model_params, master_params, flat_master=flat)
        grads = torch.cat([p.grad.float().reshape(-1) for p in model_params])
        assert torch.equal(torch.cat([m.grad.reshape(-1) for m in master_params]), grads)
        with torch.no_grad():
            for m in master_params:
                m.sub_(1.0)
        master_params_to_model_params(model_params, master_params, flat_master=flat)
        assert torch.equal(torch.cat([p.reshape(-1) for p in model_params]).float(),
                           torch.cat([m.reshape(-1) for m in master_params]).half().float())
    assert FP16_Module(nn.Linear(6, 3))(_x(0, torch.float32)).dtype == torch.float32
