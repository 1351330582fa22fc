"""apex's ``amp_C`` / ``apex_C`` / ``multi_tensor_apply`` (``overdrive.apex``) against float64 references, and the
loss scaler's ``_overflow_buf`` / ``update_scale()`` with ``scale_loss(..., delay_overflow_check=True)``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.apex import amp, amp_C, apex_C
from overdrive.apex.multi_tensor_apply import multi_tensor_applier

BF16 = torch.bfloat16
# fp32 math into an output of dtype: the reference rounded once to it
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, BF16: 8e-3}


def _tensors(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * 3).to(dtype) for shape in ((5, 7), (13,), (2, 3, 4))]


def _noop() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_multi_tensor_scale_matches_float64_and_flags_only_nonfinite_inputs(dtype: torch.dtype) -> None:
    ins = _tensors(dtype)
    outs = [torch.empty(t.shape) for t in ins]  # fp32 outputs, as DLE BERT's all-reduce buffer
    noop = _noop()
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [ins, outs], 0.125)
    for i, o in zip(ins, outs):
        torch.testing.assert_close(o.double(), i.double() * 0.125, rtol=1e-7, atol=0)  # exact: power of two
    assert noop.item() == 0
    # in place, into the input's dtype, and a huge scale whose product overflows is not an input overflow (apex)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [ins, ins], 3.0)
    assert noop.item() == 0
    ins[1][4] = float("nan")
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [ins, outs], 1.0)
    assert noop.item() == 1
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [_tensors(dtype), outs], 1.0)
    assert noop.item() == 1  # only ever set, never cleared, as apex's kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("arg_to_check", [-1, 0, 1])
def test_multi_tensor_axpby_matches_float64(dtype: torch.dtype, arg_to_check: int) -> None:
    xs, ys = _tensors(dtype, 1), _tensors(torch.float32, 2)
    outs = [torch.empty(t.shape, dtype=dtype) for t in xs]
    noop = _noop()
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [xs, ys, outs], 0.7, -1.5, arg_to_check)
    for x, y, o in zip(xs, ys, outs):
        want = 0.7 * x.double() + -1.5 * y.double()
        assert (o.double() - want).abs().max() <= TOL[dtype] * want.abs().max()
    assert noop.item() == 0
    ys[0][0, 0] = float("inf")  # an inf in y: flagged unless only x is checked
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [xs, ys, outs], 1.0, 1.0, arg_to_check)
    assert noop.item() == (0 if arg_to_check == 0 else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
def test_multi_tensor_l2norm_matches_float64(dtype: torch.dtype) -> None:
    ts = _tensors(dtype, 3)
    noop = _noop()
    total, each = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [ts], True)
    want = torch.stack([t.double().norm() for t in ts])
    assert total.dtype == each.dtype == torch.float32 and total.shape == (1,) and each.shape == (3,)
    torch.testing.assert_close(each.double(), want, rtol=1e-6, atol=0)  # fp32 sums of the same rounded inputs
    torch.testing.assert_close(total.double(), want.norm().reshape(1), rtol=1e-6, atol=0)
    assert multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [ts])[1].numel() == 0 and noop.item() == 0
    ts[2][0, 0, 0] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [ts], False)
    assert noop.item() == 1


def test_apex_c_unflatten_gives_views_of_the_flat_buffer() -> None:
    ts = _tensors(torch.float32)
    flat = apex_C.flatten(ts)
    torch.testing.assert_close(flat, torch.cat([t.reshape(-1) for t in ts]), rtol=0, atol=0)
    views = apex_C.unflatten(flat, ts)
    flat.mul_(2)  # DLE BERT's all-reduce writes the flat buffer and reads the views
    for v, t in zip(views, ts):
        torch.testing.assert_close(v, 2 * t, rtol=0, atol=0)
    with pytest.raises(Exception, match="holds|hold"):
        apex_C.unflatten(flat[:-1], ts)


def test_amp_c_names_the_optimizer_for_its_fused_optimizer_ops() -> None:
    with pytest.raises(AttributeError, match="FusedAdam"):
        amp_C.multi_tensor_adam  # noqa: B018


def _o2(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O2", dtype=BF16, loss_scale="dynamic")


def _backward(model: nn.Module, opt: torch.optim.Optimizer, inf: bool = False, delay: bool = True) -> None:
    hook = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf"))) if inf else None
    with amp.scale_loss(model(torch.ones(3, 4)).float().square().mean(), opt, delay_overflow_check=delay) as s:
        s.backward()
    if hook is not None:
        hook.remove()


def test_delayed_check_leaves_the_scale_to_update_scale_and_no_skip_pending() -> None:
    model, opt = _o2()
    scaler = amp._amp_state.loss_scalers[0]
    _backward(model, opt, inf=True)
    assert scaler.loss_scale() == 2.0**16 and scaler._overflow_buf.item() == 1  # found, not acted on yet
    assert scaler.update_scale() is True and scaler.loss_scale() == 2.0**15  # apex: the script skips the step
    opt.zero_grad()
    for _, m in amp.mixed_precision_of(opt).master_pairs():
        m.grad = None  # DLE BERT clears the masters' grads after a skipped step
    before = [p.detach().clone() for p in amp.master_params(opt)]
    _backward(model, opt)
    assert scaler.update_scale() is False
    opt.step()  # a clean step after the overflow is applied (no skip was left pending)
    assert any(not torch.equal(b, p) for b, p in zip(before, amp.master_params(opt)))
    assert scaler.loss_scale() == 2.0**15 and amp._amp_state.loss_scalers[0]._unskipped == 1


def test_delayed_check_without_update_scale_is_made_at_the_step() -> None:
    model, opt = _o2()
    before = [p.detach().clone() for p in amp.master_params(opt)]
    _backward(model, opt, inf=True)
    opt.step()  # no update_scale(): the step checks, skips and backs off
    assert all(torch.equal(b, p) for b, p in zip(before, amp.master_params(opt)))
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert amp.mixed_precision_of(opt).skipped_steps == 1


def test_gradients_made_inf_after_a_delayed_check_are_not_applied() -> None:
    model, opt = _o2()
    scaler = amp._amp_state.loss_scalers[0]
    before = [p.detach().clone() for p in amp.master_params(opt)]
    _backward(model, opt)
    assert scaler.update_scale() is False
    next(iter(amp.master_params(opt))).grad[0, 0] = float("nan")  # what a hand-written all-reduce can bring
    opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, amp.master_params(opt)))


def test_scale_loss_writes_its_overflow_to_the_buffer_and_updates_at_once_without_delay() -> None:
    model, opt = _o2()
    scaler = amp._amp_state.loss_scalers[0]
    _backward(model, opt, inf=True, delay=False)
    assert scaler._overflow_buf.item() == 1 and scaler.loss_scale() == 2.0**15
    opt.zero_grad()
    _backward(model, opt, delay=False)
    assert scaler._overflow_buf.item() == 0
