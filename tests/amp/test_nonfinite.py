"""A step with inf/NaN gradients (or an inf/NaN loss) is never applied, at any opt level or loss scale.

Reference: torch's GradScaler, which skips a step whose gradients hold inf/NaN after one fused check and one
host sync. Before, the default bf16 policy (static scale 1) and O0 applied such a step: the weights became
NaN, the loss stayed NaN for the rest of the epoch, and nothing said so until ``fit`` ended the epoch.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from overdrive import OverdriveError, UsageError, amp
from overdrive.amp import Policy, prepare
from overdrive.amp.scaler import WARN_AFTER_SKIPS

INF, NAN = float("inf"), float("nan")
BF16 = torch.bfloat16
# every level with its default scale on the CPU (static 1.0: bf16 needs none), and a static scale that is not 1
STATIC = {
    "O0": Policy(opt_level="O0"),
    "O1": Policy(opt_level="O1", dtype=BF16),
    "O2": Policy(opt_level="O2", dtype=BF16),
    "O3": Policy(opt_level="O3", dtype=BF16),
    "O2-scale128": Policy(opt_level="O2", dtype=BF16, loss_scale=128.0),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _setup(policy: Policy) -> tuple[nn.Module, torch.optim.Optimizer, amp.MixedPrecision]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, prepare(model, opt, policy)


def _step(mp: amp.MixedPrecision, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
          grad_poison: float | None = None, loss_poison: float | None = None) -> bool:
    x, y = batch
    with mp.autocast():
        out = model(x).float()  # (B, 3)
    if grad_poison is not None:  # a finite loss whose gradient turns inf/NaN in backward
        out.register_hook(lambda g: g * grad_poison)
    loss = nn.functional.cross_entropy(out, y)
    if loss_poison is not None:  # an inf/NaN loss whose gradients stay finite (a term no parameter feeds)
        loss = loss + torch.tensor(loss_poison)
    mp.backward(loss)
    stepped = mp.step()
    mp.zero_grad()
    return stepped


def _state(model: nn.Module, mp: amp.MixedPrecision, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Everything a step changes: model weights, fp32 masters (O2), momentum buffers."""
    out = [t.detach().clone() for t in model.state_dict().values()]
    out += [q.detach().clone() for q in mp.master_params()]
    out += [s["momentum_buffer"].clone() for s in opt.state.values() if s.get("momentum_buffer") is not None]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("value", [INF, NAN])
@pytest.mark.parametrize("name", list(STATIC))
def test_a_nonfinite_gradient_is_skipped_counted_and_warned(name: str, value: float) -> None:
    model, opt, mp = _setup(STATIC[name])
    data = _data(4)
    assert _step(mp, model, data[0]) and _step(mp, model, data[1])
    before = _state(model, mp, opt)
    with pytest.warns(RuntimeWarning, match=r"step 2: the gradients hold inf or NaN.*skipped \(the weights are "
                                            r"unchanged\) and counted.*lower the learning rate.*dynamic") as seen:
        assert _step(mp, model, data[2], grad_poison=value) is False
    assert len([w for w in seen if issubclass(w.category, RuntimeWarning)]) == 1
    assert _same(before, _state(model, mp, opt))  # not applied: weights, masters, momentum as they were
    assert mp.skipped_steps == 1
    assert _step(mp, model, data[3])  # and training goes on
    after = _state(model, mp, opt)
    assert not _same(before, after) and all(torch.isfinite(t.float()).all() for t in after)


@pytest.mark.parametrize("name", list(STATIC))
def test_a_skipped_step_is_as_if_its_batch_was_not_there(name: str) -> None:
    """Numerics: a poisoned step in the middle leaves exactly the run without that batch (bit for bit)."""
    data = _data(5)
    model, opt, mp = _setup(STATIC[name])
    ref_model, ref_opt, ref_mp = _setup(STATIC[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i, b in enumerate(data):
            _step(mp, model, b, grad_poison=NAN if i == 2 else None)
    for i, b in enumerate(data):
        if i != 2:
            _step(ref_mp, ref_model, b)
    assert _same(_state(model, mp, opt), _state(ref_model, ref_mp, ref_opt))


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_a_skipped_step_matches_a_plain_torch_loop_without_that_batch(level: str) -> None:
    """Against plain PyTorch (SGD, autocast bf16 at O1) over the clean batches: equal to 0 ulp, as the check
    only reads the gradients (it multiplies them by 1.0)."""
    data = _data(5)
    model, opt, mp = _setup(STATIC[level])
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with pytest.warns(RuntimeWarning, match="step 1: the gradients"):
        for i, b in enumerate(data):
            _step(mp, model, b, grad_poison=INF if i == 1 else None)
    for i, (x, y) in enumerate(data):
        if i == 1:
            continue
        with torch.autocast("cpu", dtype=BF16, enabled=level == "O1"):
            out = ref(x).float()
        nn.functional.cross_entropy(out, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_apex_surface_skips_at_every_level(level: str) -> None:
    # amp.initialize's defaults (bf16 on the CPU, static scale 1), scale_loss and the user's own opt.step()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level)
    before = [q.detach().clone() for q in model.parameters()]
    x, y = _data(1)[0]
    loss = nn.functional.cross_entropy(model(x).float(), y) * INF
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    with pytest.warns(RuntimeWarning, match="step 0: the loss is inf or NaN"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert amp.apex._lookup(opt).skipped_steps == 1


@pytest.mark.parametrize("name", ["O0", "O1", "O3", "O2-scale128", "dynamic"])
def test_an_inf_loss_with_finite_gradients_is_not_applied(name: str) -> None:
    policy = STATIC.get(name) or Policy(opt_level="O1", dtype=BF16, loss_scale="dynamic")
    model, opt, mp = _setup(policy)
    data = _data(2)
    _step(mp, model, data[0])
    before = _state(model, mp, opt)
    with pytest.warns(RuntimeWarning, match="step 1: the loss is inf or NaN"):
        assert _step(mp, model, data[1], loss_poison=NAN) is False
    assert _same(before, _state(model, mp, opt)) and mp.skipped_steps == 1


@pytest.mark.parametrize("name", list(STATIC))
def test_on_nonfinite_raise_names_the_step(name: str) -> None:
    model, opt, mp = _setup(STATIC[name].replace(on_nonfinite="raise"))
    data = _data(4)
    for b in data[:3]:
        _step(mp, model, b)
    before = _state(model, mp, opt)
    scale = r"( \(static loss scale 128\))?"
    with pytest.raises(OverdriveError, match=rf"^step 3: the gradients hold inf or NaN{scale}; the step was not "
                                             r"applied, and on_nonfinite='raise' stops the run here. To fix: lower"):
        _step(mp, model, data[3], grad_poison=INF)
    assert _same(before, _state(model, mp, opt))
    mp.zero_grad()
    assert _step(mp, model, data[0])  # a caught error leaves no skip behind: the next clean step is applied
    assert not _same(before, _state(model, mp, opt))


def test_n_consecutive_skipped_steps_stop_the_run() -> None:
    # the default policy: skip and warn once, then after WARN_AFTER_SKIPS (the dynamic floor's count) stop
    assert Policy().max_consecutive_skips == WARN_AFTER_SKIPS == 50
    model, opt, mp = _setup(STATIC["O1"])
    data = _data(1)
    _step(mp, model, data[0])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(WARN_AFTER_SKIPS - 1):
            assert _step(mp, model, data[0], grad_poison=NAN) is False
        with pytest.raises(OverdriveError, match=r"^training diverged: 50 optimizer steps in a row \(steps 1 to 50\) "
                                                 r"were skipped for inf/NaN.*max_consecutive_skips=None"):
            _step(mp, model, data[0], grad_poison=NAN)
    assert [str(w.message)[:8] for w in seen if issubclass(w.category, RuntimeWarning)] == ["step 1: "]  # once
    assert mp.skipped_steps == 50


def test_a_clean_step_ends_a_run_of_skips() -> None:
    model, opt, mp = _setup(STATIC["O0"].replace(max_consecutive_skips=3))
    data = _data(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(4):  # 2 skips, a clean step, 2 skips: never 3 in a row
            _step(mp, model, data[0], grad_poison=INF)
            _step(mp, model, data[0], grad_poison=INF)
            _step(mp, model, data[0])
    assert mp.skipped_steps == 8 and len(seen) == 4  # one warning per run of skips
    with pytest.warns(RuntimeWarning, match="step 12: "), \
            pytest.raises(OverdriveError, match="3 optimizer steps in a row"):
        for _ in range(3):
            _step(mp, model, data[0], grad_poison=INF)


def test_dynamic_scale_backs_off_quietly_and_speaks_at_its_floor() -> None:
    # an overflow at scale 2 is routine (x0.5, skip); at the floor (1.0) no smaller scale helps: warn / raise
    model, opt, mp = _setup(Policy(opt_level="O1", dtype=BF16, loss_scale="dynamic", init_scale=2.0))
    data = _data(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _step(mp, model, data[0], grad_poison=INF) is False
    assert mp.loss_scale == 1.0 and mp.skipped_steps == 1
    with pytest.warns(RuntimeWarning, match="step 1: the gradients overflow .* even at the loss scale floor 1"):
        assert _step(mp, model, data[1], grad_poison=INF) is False
    model, opt, mp = _setup(Policy(opt_level="O1", dtype=BF16, loss_scale="dynamic", init_scale=2.0,
                                   on_nonfinite="raise"))
    assert _step(mp, model, data[0], grad_poison=INF) is False  # routine: no error
    with pytest.raises(OverdriveError, match="step 1: the gradients overflow"):
        _step(mp, model, data[1], grad_poison=INF)


def test_every_inf_loss_under_a_dynamic_scale_stops_after_n_steps() -> None:
    # before: 200 skipped steps, a warning at 50 and the run went on
    model, opt, mp = _setup(Policy(opt_level="O1", dtype=BF16, loss_scale="dynamic"))
    data = _data(1)
    with pytest.warns(RuntimeWarning, match="step 0: the loss is inf"), \
            pytest.raises(OverdriveError, match=r"training diverged: 50 optimizer steps in a row \(steps 0 to 49\)"):
        for _ in range(200):
            _step(mp, model, data[0], loss_poison=INF)
    assert mp.skipped_steps == 50


class _CountChecks(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["O0", "O2", "O3", "dynamic"])
def test_one_fused_check_per_step_and_none_twice(name: str) -> None:
    # one fused kernel for all (6) gradients at the step, not a loop over parameters; a dynamic scale checks
    # in backward already, and its step does not check again
    dynamic = name == "dynamic"
    policy = Policy(opt_level="O2", dtype=BF16, loss_scale="dynamic") if dynamic else STATIC[name]
    model, opt, mp = _setup(policy)
    x, y = _data(1)[0]
    with mp.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), y)
    backward, step = _CountChecks(), _CountChecks()
    with backward:
        mp.backward(loss)
    with step:
        assert mp.step()
    assert len(list(mp.master_params())) == 6
    assert (backward.n, step.n) == ((1, 0) if dynamic else (0, 1))


def test_policy_option_is_validated_and_round_trips() -> None:
    with pytest.raises(UsageError, match="on_nonfinite='ignore' is not one of 'skip', 'raise'"):
        Policy(on_nonfinite="ignore")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(UsageError, match="max_consecutive_skips="):
            Policy(max_consecutive_skips=bad)
    p = Policy(opt_level="O2", dtype=BF16, on_nonfinite="raise", max_consecutive_skips=None)
    assert Policy.from_json(p.to_json()) == p and p.resolve("cpu").on_nonfinite == "raise"
    model = _model()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                on_nonfinite="raise", max_consecutive_skips=7)
    assert amp.apex._lookup(opt).policy.on_nonfinite == "raise"
    assert amp.apex._lookup(opt).guard.max_consecutive == 7


def test_two_optimizers_are_counted_and_named_apart() -> None:
    # a GAN's generator keeps its clean steps while the discriminator's inf/NaN ones are skipped
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    mp = prepare([gen, disc], [opt_g, opt_d], Policy(opt_level="O1", dtype=BF16))
    g_before = copy.deepcopy(gen.state_dict())
    x = torch.randn(8, 4)
    with mp.autocast():
        d_loss = disc(gen(x).detach()).float().sum()
    with mp.scale_loss(d_loss * NAN, [opt_d]) as s:
        s.backward()
    with mp.autocast():
        g_loss = -disc(gen(x)).float().sum()
    with mp.scale_loss(g_loss, [opt_g]) as s:
        s.backward()
    with pytest.warns(RuntimeWarning, match="optimizer 1 step 0: the loss is inf or NaN"):
        opt_d.step()
    opt_g.step()
    assert not torch.equal(gen.weight, g_before["weight"]) and torch.isfinite(gen.weight).all()
    assert mp.skipped_steps == 1
