"""apex.amp behaviours a migrating script relies on (CPU, bf16, tiny models)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive import UsageError, amp

BF16 = torch.bfloat16


def test_initialize_disabled_leaves_scale_loss_a_pass_through() -> None:
    # apex scripts do `amp.initialize(model, opt, enabled=args.amp)` and keep every `amp.scale_loss` block
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_live = len(amp.state_dict())  # other tests' runs may still be registered
    model, opt = amp.initialize(model, opt, opt_level="O2", enabled=False)
    assert model.weight.dtype == torch.float32
    loss = model(torch.ones(3, 4)).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    before = model.weight.detach().clone()
    opt.step()
    assert torch.allclose(model.weight, before - 0.1 * 3.0)  # d(sum)/dW = 3 per entry
    assert len(amp.state_dict()) == n_live  # a disabled call adds no loss scaler (apex: none)


def test_patch_torch_functions_is_accepted_at_its_opt_level() -> None:
    m = nn.Linear(4, 2)
    # apex's positional order: ..., cast_model_type, patch_torch_functions, keep_batchnorm_fp32, ...
    m, o = amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), True, "O1", None, True, dtype=BF16)
    out = m(torch.ones(1, 4))  # O1's autocast: bf16 values, handed back in float32 (numpy has no bfloat16)
    assert out.dtype == torch.float32 and torch.equal(out, out.to(BF16).float())
    m2 = nn.Linear(4, 2)
    amp.initialize(m2, torch.optim.SGD(m2.parameters(), lr=0.1), opt_level="O2", patch_torch_functions=False,
                   dtype=BF16)
    m3 = nn.Linear(4, 2)
    with pytest.raises(UsageError, match="patch_torch_functions=True at opt_level='O2'"):
        amp.initialize(m3, torch.optim.SGD(m3.parameters(), lr=0.1), opt_level="O2", patch_torch_functions=True,
                       dtype=BF16)


def test_o2_parameter_shared_by_two_models_stays_shared_and_gets_both_grads() -> None:
    torch.manual_seed(0)
    enc, head = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    head.weight = enc.weight  # one Parameter in two models
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    (enc, head), opt = amp.initialize([enc, head], opt, opt_level="O2", dtype=BF16)
    assert enc.weight is head.weight and enc.weight.dtype == BF16
    x = torch.ones(2, 4)
    with amp.scale_loss(enc(x).sum() + head(x).sum(), opt) as scaled:
        scaled.backward()
    (master,) = amp.master_params(opt)
    assert torch.equal(master.grad, torch.full((4, 4), 4.0))  # 2 rows of ones, from each model
    opt.step()
    assert torch.equal(head.weight.detach(), master.detach().to(BF16))


@pytest.mark.parametrize("how", ["half model", "initialized twice"])
def test_o2_refuses_a_model_that_is_already_half(how: str) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    if how == "half model":
        model = model.to(BF16)
    else:
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", dtype=BF16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"parameter '0.weight' is already torch.bfloat16.*float32 model"):
        amp.initialize(model, opt, opt_level="O2", dtype=BF16)


def test_overflow_skips_only_the_optimizer_whose_loss_overflowed() -> None:
    # a GAN under one initialize call: D's loss overflows, G's next clean step must still happen
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    (gen, disc), (opt_g, opt_d) = amp.initialize(
        [gen, disc], [opt_g, opt_d], opt_level="O1", dtype=BF16, loss_scale="dynamic"
    )
    x = torch.randn(2, 4)
    d_before = disc.weight.detach().clone()
    with amp.scale_loss(disc(gen(x).detach()).sum() * float("inf"), opt_d) as scaled:
        scaled.backward()
    opt_d.step()
    assert torch.equal(disc.weight, d_before)  # skipped
    opt_g.zero_grad()
    opt_d.zero_grad()
    g_before = gen.weight.detach().clone()
    with amp.scale_loss(disc(gen(x)).sum(), opt_g) as scaled:
        scaled.backward()
    opt_g.step()
    assert not torch.equal(gen.weight, g_before)
    # a loss whose overflow reaches another optimizer's grads skips that one too (no inf step)
    opt_g.zero_grad()
    opt_d.zero_grad()
    with amp.scale_loss(disc(gen(x)).sum() * float("inf"), opt_d) as scaled:
        scaled.backward()
    g_before = gen.weight.detach().clone()
    opt_g.step()
    assert torch.equal(gen.weight, g_before)


def test_o2_param_group_added_after_initialize_gets_fp32_masters() -> None:
    # fine-tuning: the backbone is frozen (not in the optimizer) at initialize and added later
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model[1].parameters(), lr=1.0)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=BF16)
    opt.add_param_group({"params": model[0].parameters(), "lr": 1e-4})
    start = model[0].bias.detach().float().clone()
    for _ in range(4):
        with amp.scale_loss(model(torch.ones(1, 4))[:, 0].sum() * 0.0 + model[0].bias.sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    masters = list(amp.master_params(opt))
    assert all(m.dtype == torch.float32 for m in masters)
    # steps of 1e-4 are rounded away or off in bf16 (8 significant bits) but kept by the fp32 master
    assert torch.allclose(masters[3], start - 4e-4, atol=1e-6)
    assert torch.equal(model[0].bias.detach(), masters[3].detach().to(BF16))
    assert len(amp.apex._lookup(opt).state_dict()["master_params"]) == 4


def test_state_dict_keeps_apex_keys_at_the_top_of_each_entry() -> None:
    m = nn.Linear(4, 2)
    m, o = amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1", dtype=BF16,
                          loss_scale="dynamic")
    state = amp.state_dict()
    mine = state[max(state, key=lambda k: int(k.removeprefix("loss_scaler")))]  # the latest initialize call
    assert mine["loss_scale"] == 2.0**16 and mine["unskipped"] == 0
    amp.load_state_dict(state)  # overdrive's own state is still underneath  # still overdrive's own format underneath
