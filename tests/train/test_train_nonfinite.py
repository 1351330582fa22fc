"""Trainer.train_step reports an inf/NaN loss or gradient at the step it happens, naming ``step_count``.

Before, with the default policies (O0, and bf16's static scale 1) the step was applied: the weights became
NaN, the loss stayed NaN, and only ``fit`` said so, at the end of the epoch ("training diverged").
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive import OverdriveError
from overdrive.amp import Policy
from overdrive.train import Trainer, load_checkpoint, save_checkpoint

NAN = float("nan")
POLICIES = {"O0": "O0", "O1-bf16": Policy(opt_level="O1", dtype=torch.bfloat16),
            "O2-bf16": Policy(opt_level="O2", dtype=torch.bfloat16)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))


def _data(n: int, nan_at: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]
    for i in nan_at:  # one NaN input: a NaN loss, and NaN gradients
        data[i][0][0, 0] = NAN
    return data


def _trainer(policy: Policy | str, **kw: object) -> Trainer:
    m = _model()
    return Trainer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), policy=policy, progress=False, **kw)


def _weights(t: Trainer) -> list[torch.Tensor]:
    return [q.detach().clone() for q in t.mp.master_params()]


@pytest.mark.parametrize("name", list(POLICIES))
def test_train_step_reports_a_nan_loss_at_once(name: str) -> None:
    t = _trainer(POLICIES[name])
    data = _data(5, nan_at=(3,))
    for b in data[:3]:
        t.train_step(b)
    before = _weights(t)
    with pytest.warns(RuntimeWarning, match=r"^step 3: the loss is inf or NaN; the optimizer step was skipped"):
        loss = t.train_step(data[3])  # this call, not the end of the epoch
    assert torch.isnan(loss) and t.skipped_steps == 1 and t.step_count == 4
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(t)))
    t.train_step(data[4])
    assert all(torch.isfinite(q).all() for q in _weights(t))


@pytest.mark.parametrize("name", list(POLICIES))
def test_train_step_raises_with_on_nonfinite_raise(name: str) -> None:
    policy = POLICIES[name] if isinstance(POLICIES[name], Policy) else Policy(opt_level="O0")
    t = _trainer(policy.replace(on_nonfinite="raise"))
    data = _data(3, nan_at=(2,))
    t.train_step(data[0])
    t.train_step(data[1])
    before = _weights(t)
    with pytest.raises(OverdriveError, match=r"^step 2: the loss is inf or NaN; the step was not applied"):
        t.train_step(data[2])
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(t)))


def test_the_step_named_is_the_trainers_after_a_resume(tmp_path: Path) -> None:
    t = _trainer("O0")
    data = _data(3, nan_at=(2,))
    for b in data[:2]:
        t.train_step(b)
    path = save_checkpoint(tmp_path / "c.pt", t)
    resumed = _trainer("O0")
    load_checkpoint(path, resumed)
    resumed.step_count = 100  # what a resume of a longer run sets
    with pytest.warns(RuntimeWarning, match=r"^step 100: the loss is inf or NaN"):
        resumed.train_step(data[2])


def test_with_accumulation_the_call_closing_the_window_reports() -> None:
    t = _trainer("O0", accumulate=2)
    data = _data(4, nan_at=(2,))
    t.train_step(data[0])
    t.train_step(data[1])
    before = _weights(t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.train_step(data[2])  # the NaN micro-batch: nothing is stepped yet
    with pytest.warns(RuntimeWarning, match=r"^step 1: the loss is inf or NaN"):
        t.train_step(data[3])
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(t))) and t.skipped_steps == 1


def test_fit_skips_a_nan_step_and_goes_on() -> None:
    # before: the weights became NaN at batch 2 and fit raised "training diverged" at the end of the epoch
    t = _trainer(POLICIES["O1-bf16"])
    data = _data(6, nan_at=(2,))
    with pytest.warns(RuntimeWarning, match="step [28]: the loss is inf or NaN") as seen:
        result = t.fit(data, epochs=2)
    assert [str(w.message)[:7] for w in seen] == ["step 2:", "step 8:"]  # reported where each happened
    assert [e.skipped_steps for e in result.history] == [1, 1]
    assert all(torch.isfinite(q).all() for q in _weights(t))
    ref = _trainer(POLICIES["O1-bf16"])  # the same run without the NaN batch: the mean is over the finite losses
    clean = [b for i, b in enumerate(data) if i != 2]
    losses = [float(ref.train_step(b)) for b in clean]
    assert result.history[0].loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_finite_training_matches_a_plain_torch_loop(level: str) -> None:
    """The check costs nothing in numerics: 0 ulp from plain PyTorch (AdamW; autocast bf16 at O1), as before."""
    policy = "O0" if level == "O0" else Policy(opt_level="O1", dtype=torch.bfloat16)
    t = _trainer(policy)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in _data(6):
        t.train_step((x, y))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=level == "O1"):
            out = ref(x)
        nn.functional.cross_entropy(out.float(), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(t.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert t.skipped_steps == 0


def test_a_nan_loss_mid_accumulation_survives_a_checkpoint(tmp_path: Path) -> None:
    # the pending record of an inf/NaN loss (static scale: kept on the device until the step) is saved
    # with the half-done accumulation, so the resumed run skips the same step; here the loss is NaN with
    # finite gradients, which only that record catches
    base = _model()

    def make() -> Trainer:
        m = copy.deepcopy(base)

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            bad = torch.tensor(NAN) if bool(y[0] < 0) else torch.tensor(0.0)  # a term no parameter feeds
            return nn.functional.cross_entropy(out, y.clamp(min=0)) + bad

        return Trainer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), policy="O0", accumulate=3, loss_fn=loss_fn,
                       progress=False)

    data = _data(6)
    data[3][1][0] = -1  # micro-batch 3 (the first of the second window) has the NaN loss
    ref = make()
    with pytest.warns(RuntimeWarning, match="step 1: the loss is inf or NaN"):
        for b in data:
            ref.train_step(b)
    a = make()
    for b in data[:4]:
        a.train_step(b)
    path = save_checkpoint(tmp_path / "mid.pt", a)
    resumed = make()
    load_checkpoint(path, resumed)
    with pytest.warns(RuntimeWarning, match="step 1: the loss is inf or NaN"):
        for b in data[4:]:
            resumed.train_step(b)
    assert resumed.skipped_steps == ref.skipped_steps == 1
    for p, q in zip(ref.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("level", ["O0", "O2_bf16"])
def test_an_empty_batch_is_a_zero_gradient_not_a_skipped_step(level: str) -> None:
    """A batch of no samples (overdrive.data yields one when all its files were undecodable) reports a NaN loss
    but is not a non-finite step: no warning, nothing skipped, a zero gradient (plain SGD leaves the weights
    unchanged), the custom loss is not called on it, and fit's mean is over the other batches. Before, the NaN
    mean made the step a skipped one, which under DDP only the empty rank skipped."""
    policy = Policy(opt_level="O2", dtype=torch.bfloat16) if level == "O2_bf16" else "O0"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    calls = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(out.shape[0])
        return nn.functional.cross_entropy(out, y)

    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, progress=False, loss_fn=loss_fn)
    before = copy.deepcopy(t.model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = t.train_step((torch.empty(0, 4), torch.empty(0, dtype=torch.long)))
    assert torch.isnan(loss) and t.skipped_steps == 0 and t.step_count == 1 and calls == []
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
    with torch.no_grad(), t.mp.autocast():
        first = float(nn.functional.cross_entropy(t.forward(full[0]).float(), full[1]))  # before fit's first step
    res = t.fit([full, (torch.empty(0, 4), torch.empty(0, dtype=torch.long))], epochs=1)
    assert res.history[0].skipped_steps == 0 and res.history[0].samples == 6
    assert res.final_loss == pytest.approx(first, abs=1e-6)  # the empty batch's NaN is left out of the mean
