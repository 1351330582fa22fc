"""The native API under a demanding user: a second prepare of one optimizer, a GAN whose generator's loss
overflows into the discriminator's gradients, and bad Policy / prepare arguments.

References: a run prepared once (a second prepare used to apply O2's gradients multiplied by the loss scale),
and the same GAN run without the overflow (the discriminator's next clean step used to be skipped).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive import UsageError
from overdrive.amp import Policy, prepare

BF16 = torch.bfloat16


def _train(mp: object, model: nn.Module, steps: int = 4) -> list[float]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    losses = []
    for _ in range(steps):
        with mp.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        with mp.scale_loss(loss) as scaled:
            scaled.backward()
        mp.step()
        mp.zero_grad()
        losses.append(loss.item())
    return losses


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_second_prepare_of_one_optimizer_is_refused(level: str) -> None:
    # O2 prepared twice with loss_scale=4 stepped on gradients 4x too large (65536x with a dynamic scale), silently
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(opt_level=level, dtype=BF16, loss_scale=4.0)
    first = prepare(model, opt, policy)
    with pytest.raises(UsageError, match=rf"SGD was already prepared \(opt_level '{level}'\).*prepare each model and "
                                         r"optimizer once.*\.remove\(\)"):
        prepare(model, opt, policy)
    # the first MixedPrecision still trains as a run prepared once (same numbers: nothing was half-applied)
    ref_model = _net()
    ref = prepare(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), policy)
    assert _train(first, model) == _train(ref, ref_model)


def test_prepare_again_after_remove_at_o1() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, Policy(opt_level="O1", dtype=BF16)).remove()
    mp = prepare(model, opt, Policy(opt_level="O1", dtype=BF16))
    ref_model = _net()
    ref = prepare(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), Policy(opt_level="O1", dtype=BF16))
    assert _train(mp, model) == _train(ref, ref_model)


def _gan_discriminator_after(policy: Policy, overflow: bool, zero_disc_grads: bool = True) -> tuple[torch.Tensor, int]:
    """Three GAN iterations (D step, then G step); with ``overflow`` the G loss of iteration 1 is inf, which reaches
    D's gradients. D's own loss is on real data only, so D's weights do not depend on G's skipped step."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    mp = prepare([gen, disc], [opt_g, opt_d], policy, num_losses=2)
    g = torch.Generator().manual_seed(2)
    real, z = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    for it in range(3):
        if zero_disc_grads or it == 0:
            opt_d.zero_grad()
        with mp.autocast():
            d_loss = nn.functional.softplus(-disc(real)).float().mean()
        with mp.scale_loss(d_loss, [opt_d], loss_id=0) as scaled:
            scaled.backward()
        opt_d.step()
        opt_g.zero_grad()
        with mp.autocast():
            g_loss = nn.functional.softplus(-disc(gen(z))).float().mean()
        if overflow and it == 1:
            g_loss = g_loss * float("inf")
        with mp.scale_loss(g_loss, [opt_g], loss_id=1) as scaled:
            scaled.backward()
        opt_g.step()
    return torch.cat([q.detach().float().flatten() for q in mp.master_params(opt_d)]), mp.skipped_steps


GAN_POLICIES = {
    "O1-bf16": Policy(opt_level="O1", dtype=BF16),
    "O1-dynamic": Policy(opt_level="O1", dtype=BF16, loss_scale="dynamic"),
    "O2-bf16": Policy(opt_level="O2", dtype=BF16),
    "O2-dynamic": Policy(opt_level="O2", dtype=BF16, loss_scale="dynamic"),
}


@pytest.mark.parametrize("name", list(GAN_POLICIES))
def test_generator_overflow_does_not_skip_the_discriminators_next_clean_step(name: str) -> None:
    # The G loss reaches D's gradients; D zeroes them and computes fresh ones before its next step. That step is
    # clean and must be applied: D's weights equal the run without the overflow exactly. Only G's step is skipped.
    policy = GAN_POLICIES[name]
    clean, skipped_clean = _gan_discriminator_after(policy, overflow=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit, skipped_hit = _gan_discriminator_after(policy, overflow=True)
    assert skipped_clean == 0 and skipped_hit == 1
    assert torch.equal(hit, clean)
    assert not any("optimizer 1" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.parametrize("name", list(GAN_POLICIES))
def test_discriminator_grads_left_inf_are_still_not_applied(name: str) -> None:
    # without D's zero_grad, the inf that G's loss wrote into D's gradients is still there at D's step: skipped
    hit, skipped = _gan_discriminator_after(GAN_POLICIES[name], overflow=True, zero_disc_grads=False)
    assert torch.isfinite(hit).all()
    assert skipped >= 2  # G's step, and D's next one


@pytest.mark.parametrize("kwargs, match", [
    ({"loss_scale": True}, r"loss_scale=True is a bool; pass 'dynamic'"),
    ({"min_loss_scale": "x"}, r"min_loss_scale='x' must be a positive number"),
    ({"max_loss_scale": None}, r"max_loss_scale=None must be a positive number"),
    ({"opt_level": "O2", "master_weights": "False"}, r"master_weights='False' must be True, False or None"),
])
def test_bad_policy_values_are_one_line_usage_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        Policy(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": {"opt_level": "O2"}}, r"policy=\{'opt_level': 'O2'\} is not an amp.Policy.*Policy.from_dict"),
    ({"policy": None}, r"policy=None is not an amp.Policy or an opt level"),
    ({"device": "gpu"}, r"device='gpu' is not a torch device"),
])
def test_bad_prepare_arguments_are_usage_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        prepare(nn.Linear(2, 2), None, **kwargs)


def test_prepare_warns_for_an_optimizer_over_none_of_the_models_parameters() -> None:
    """After mp.remove() at O2 the model stays half and the optimizer holds the fp32 masters: preparing them again
    trained nothing (the weights after a step equal those before, exactly); now a RuntimeWarning says so."""
    import warnings as _w

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mp = prepare(model, opt, Policy(opt_level="O2", dtype=torch.bfloat16))
    mp.remove()
    with pytest.warns(RuntimeWarning, match=r"optimizer 0 \(SGD\) holds none of the models' 2 parameters"):
        mp2 = prepare(model, opt, Policy(opt_level="O2", dtype=torch.bfloat16))
    before = model.weight.detach().clone()
    loss = nn.functional.cross_entropy(model(torch.randn(8, 4)).float(), torch.randint(0, 3, (8,)))
    mp2.backward(loss)
    mp2.step()
    assert torch.equal(model.weight, before)  # what the warning is about: nothing trained
    with _w.catch_warnings():  # an optimizer over the model: no warning
        _w.simplefilter("error", RuntimeWarning)
        m2 = nn.Linear(4, 3)
        prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1), "O1")


def test_prepare_for_a_device_the_model_or_torch_is_not_on_is_refused() -> None:
    """Before: device='cuda' without a GPU resolved the policy for CUDA (fp16, a dynamic scale) while torch disabled
    autocast with a warning, and trained in fp32; a CPU model prepared for CUDA failed later, inside the forward."""
    m = nn.Linear(4, 2)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match=r"device='cuda' but this torch sees no CUDA GPU"):
            prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), "O1", device="cuda")
    with pytest.raises(UsageError, match=r"device='meta' but the model's parameters are on cpu; move the model"):
        prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), "O0", device="meta")
