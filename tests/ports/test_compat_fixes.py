"""The compatibility gaps the port scripts found, each closed in the apex / ASP layer and checked here on its own."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from overdrive import UsageError

BF16 = torch.bfloat16


def test_apex_amp_dotted_imports_name_the_one_amp_module() -> None:
    # DLE BERT: `from apex.amp import _amp_state`; other scripts: `import apex.amp as amp`
    import overdrive.apex.amp as dotted
    from overdrive import amp
    from overdrive.apex.amp import _amp_state, scale_loss

    assert dotted is amp and _amp_state is amp._amp_state and scale_loss is amp.scale_loss


def test_lazy_init_maybe_master_weights_is_a_no_op_before_copying_into_masters() -> None:
    from overdrive.apex import amp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=BF16)
    saved = [torch.full_like(p, 0.25) for p in amp.master_params(optimizer)]
    # DLE BERT's resume, as written there
    optimizer._lazy_init_maybe_master_weights()
    optimizer._amp_stash.lazy_init_called = True
    for param, saved_param in zip(amp.master_params(optimizer), saved):
        param.data.copy_(saved_param.data)
    x = torch.ones(3, 4)
    with amp.scale_loss(model(x).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    # the step started from the copied masters (0.25 everywhere) and wrote them back to the half weights
    masters = list(amp.master_params(optimizer))
    assert all((m - 0.25).abs().max() < 0.02 for m in masters)
    assert torch.equal(model[0].weight, masters[0].detach().to(BF16))
    copy.deepcopy(optimizer)  # the attribute is a plain module-level function: the optimizer still copies


def test_loss_scalers_are_the_latest_initialize_calls_as_in_apex() -> None:
    from overdrive.apex import amp

    first = nn.Linear(4, 2)
    first, opt1 = amp.initialize(first, torch.optim.SGD(first.parameters(), lr=0.1), opt_level="O1", dtype=BF16)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**10
    second = nn.Linear(4, 2)
    second, opt2 = amp.initialize(second, torch.optim.SGD(second.parameters(), lr=0.1), opt_level="O1", dtype=BF16,
                                  num_losses=2, loss_scale="dynamic")
    scalers = amp._amp_state.loss_scalers
    assert len(scalers) == 2 and [s.loss_scale() for s in scalers] == [2.0**16, 2.0**16]  # the second call's
    scalers[0]._loss_scale = 2.0**12  # DLE BERT / ViT-pytorch right after initialize: this call's scaler
    assert amp.mixed_precision_of(opt2).scalers[0].scale == 2.0**12
    assert amp.mixed_precision_of(opt1).scalers[0].scale == 2.0**10  # the first call's is left alone
    del second, opt2
    gc.collect()
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [2.0**10]  # the latest one still alive


def test_asp_registry_forgets_a_deleted_model_pruned_after_amp_o2() -> None:
    from overdrive.apex import amp
    from overdrive.sparsity import ASP

    def pruned_after_o2() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=BF16)
        ASP.prune_trained_model(model, opt)
        return model, opt

    gc.collect()
    before = ASP.already_init_asp_model()
    model, opt = pruned_after_o2()
    with pytest.raises(UsageError, match="already called for this optimizer"):
        ASP.init_optimizer_for_pruning(opt)
    # the optimizer's step hooks hold amp's MixedPrecision, which holds the model: the registry must not keep
    # them alive through the optimizer it attached
    del model, opt
    gc.collect()
    assert ASP.already_init_asp_model() == before
    if not before:  # apex's no-argument calls reach the one live model
        model, opt = pruned_after_o2()
        ASP.compute_sparse_masks()
        assert ASP.is_sparsity_enabled()


def test_dle_bert_allreduce_post_accumulation_step_imports_and_skips_as_apex() -> None:
    # DLE BERT's take_optimizer_step: `import amp_C`, `apex_C`, `multi_tensor_applier` had no module here, and the
    # scaler view had no _overflow_buf / update_scale()
    from overdrive.apex import amp, amp_C, apex_C
    from overdrive.apex.multi_tensor_apply import multi_tensor_applier

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=BF16, loss_scale="dynamic")
    with amp.scale_loss(model(torch.ones(3, 4)).float().sum(), optimizer, delay_overflow_check=True) as scaled:
        scaled.backward()
    grads = [p.grad for p in amp.master_params(optimizer)]
    unscaled = [g.clone() for g in grads]
    flat = torch.empty(sum(g.numel() for g in grads))
    views = apex_C.unflatten(flat, grads)
    overflow_buf = torch.zeros(1, dtype=torch.int)
    scaler = amp._amp_state.loss_scalers[0]
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, views], scaler.loss_scale() / 2)
    flat[0] = float("inf")  # an overflow from another rank's gradients, arriving through the all-reduce
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [views, grads], 1.0 / scaler.loss_scale())
    old, scaler._overflow_buf = scaler._overflow_buf, overflow_buf
    assert scaler.update_scale() is True and scaler.loss_scale() == 2.0**15
    scaler._overflow_buf = old
    torch.testing.assert_close(grads[1], unscaled[1] / 2, rtol=0, atol=0)  # powers of two: exact
