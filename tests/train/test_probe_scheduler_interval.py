"""``Trainer(scheduler_interval="epoch")``: an epoch scheduler (StepLR counted in epochs, as torchvision's reference
scripts use it) steps once per fit epoch, after the epoch's evaluation, and training equals a hand-written torch loop
exactly. Without the setting there was no way to say it: StepLR(step_size=2) decayed every 2 optimizer steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive import UsageError
from overdrive.train import Trainer


def _setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(3)]


def test_epoch_scheduler_steps_once_per_epoch_like_a_torch_loop() -> None:
    data = _data()
    ref, ref_opt, ref_sched = _setup()
    lrs_ref = []
    for _ in range(4):
        for x, y in data:
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(x), y).backward()
            ref_opt.step()
        ref_sched.step()
        lrs_ref.append(ref_opt.param_groups[0]["lr"])

    model, opt, sched = _setup()
    t = Trainer(model, opt, scheduler=sched, scheduler_interval="epoch", progress=False)
    lrs: list[float] = []
    t.fit(data, epochs=4, eval_data=data[:1], on_epoch_end=lambda s: lrs.append(opt.param_groups[0]["lr"]))
    assert lrs == pytest.approx(lrs_ref) and lrs_ref == pytest.approx([0.5, 0.05, 0.05, 0.005])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)  # fp32, the same ops: measured 0


def test_step_interval_is_still_the_default_and_a_bad_interval_is_named() -> None:
    model, opt, sched = _setup()
    t = Trainer(model, opt, scheduler=sched, progress=False)
    t.fit(_data(), epochs=1)  # 3 optimizer steps: StepLR(step_size=2) decayed once
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    model, opt, sched = _setup()
    with pytest.raises(UsageError, match=r"scheduler_interval='epochs' must be 'step' .* or 'epoch'"):
        Trainer(model, opt, scheduler=sched, scheduler_interval="epochs", progress=False)
