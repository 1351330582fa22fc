"""overdrive.amp on a CUDA GPU: fp16 with dynamic loss scaling, bf16, compile. Run with `pytest -m gpu`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import amp
from overdrive.amp import Policy, prepare

from .conftest import Net, batch

pytestmark = pytest.mark.gpu


def learnable_batch(n: int, seed: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Labels are a fixed function of the inputs (which channel-pair has the largest mean)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 6, 6, generator=g)
    y = torch.stack([x[:, 0].mean((1, 2)), x[:, 1].mean((1, 2)), x[:, 2].mean((1, 2)), -x.mean((1, 2, 3))], 1).argmax(1)
    return x.to(device), y.to(device)


def _fit(model: nn.Module, mp: amp.MixedPrecision, steps: int, device: str = "cuda") -> list[float]:
    losses = []
    for i in range(steps):
        x, y = learnable_batch(64, seed=i % 8, device=device)
        with mp.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_levels_train_on_cuda(level: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    ref = copy.deepcopy(model)
    # SGD: pure-half O3 has no fp32 state, and Adam's eps=1e-8 underflows in fp16
    mp = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), Policy(opt_level=level, dtype=dtype))
    ref_mp = prepare(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), Policy(opt_level="O0"))
    losses, ref_losses = _fit(model, mp, 80), _fit(ref, ref_mp, 80)
    tail, ref_tail = sum(losses[-8:]) / 8, sum(ref_losses[-8:]) / 8  # one pass over the 8 batches
    assert tail < 0.5 * losses[0]
    # converges like fp32 (pure-half O3 is allowed a little more)
    assert tail < ref_tail * (1.5 if level == "O3" else 1.2) + 0.05
    if level == "O2":
        assert model.bn.weight.dtype == torch.float32 and model.conv.weight.dtype == dtype
        assert mp.policy.dynamic == (dtype is torch.float16)


def test_fp16_overflow_skips_and_backs_off_on_cuda() -> None:
    model = Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2")  # fp16 default on CUDA
    mp = amp.apex._lookup(opt)
    assert mp.policy.dtype is torch.float16 and mp.policy.dynamic
    before = [m.detach().clone() for m in amp.master_params(opt)]
    h = model.fc.weight.register_hook(lambda g: g * float("inf"))
    x, y = (t.cuda() for t in batch(32))
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    h.remove()
    assert mp.loss_scale == 2.0**15 and mp.scaler.overflows == 1
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))


def test_fp16_loss_scale_prevents_underflow() -> None:
    # gradients ~1e-8 underflow in fp16 without scaling; with the 2**16 scale they survive
    lin = nn.Linear(8, 8, bias=False).cuda()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    mp = prepare(lin, opt, Policy(opt_level="O2", dtype=torch.float16))
    x = torch.randn(4, 8, device="cuda")
    mp.backward(lin(x).float().sum() * 1e-8)
    g = next(mp.master_params()).grad
    assert g is not None and g.abs().max().item() > 0


def test_compile_o2_bf16_matches_eager_on_cuda() -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), Policy(opt_level="O2", dtype=torch.bfloat16))
    model.eval()
    x = batch(64)[0].cuda()
    torch.testing.assert_close(torch.compile(model)(x), model(x), atol=3e-2, rtol=3e-2)


def test_layernorm_fp32_under_o2_with_half_inputs_on_cuda() -> None:
    m = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GroupNorm(4, 32), nn.Linear(32, 4)).cuda()
    mp = prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), Policy(opt_level="O2", dtype=torch.float16))
    out = m(torch.randn(8, 16, device="cuda"))
    assert out.dtype == torch.float32 and m[1].weight.dtype == torch.float32
    mp.backward(out.sum())
    mp.step()


def _trainer_run(defer: bool, nan_at: int) -> tuple[object, list[torch.Tensor]]:
    from overdrive.train import Trainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).cuda()
    t = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                policy=Policy(opt_level="O2", dtype=torch.float16), progress=False)
    assert t.mp.deferred  # the CUDA default
    t.mp.defer_checks(defer)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 32, generator=g).cuda(), torch.randint(0, 4, (16,), generator=g).cuda()) for _ in range(6)]
    data[nan_at][0][0, 0] = float("nan")
    t.train_step(data[0])  # the optimizer's state is made at its first step
    if defer:  # no host sync in a training step: the verdicts are read from pinned memory after their event
        torch.cuda.set_sync_debug_mode("error")
    try:
        for b in data[1:]:
            t.train_step(b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return t, [q.detach().clone() for q in t.mp.master_params()]


def test_trainer_on_cuda_defers_its_checks_without_a_sync_and_trains_as_the_immediate_ones() -> None:
    """Reference: the same run with the checks read on the host each step; weights equal exactly, the NaN step is
    skipped (on the device) and counted, the scale backed off alike."""
    with pytest.warns(RuntimeWarning, match=r"^step 3: the loss is inf or NaN"):
        now, w_now = _trainer_run(False, nan_at=3)
    with pytest.warns(RuntimeWarning, match=r"^step 3: the loss is inf or NaN"):  # read at step 4's backward
        later, w_later = _trainer_run(True, nan_at=3)
    assert later.skipped_steps == now.skipped_steps == 1
    assert later.mp.loss_scale == now.mp.loss_scale
    assert all(torch.equal(a, b) for a, b in zip(w_now, w_later))
