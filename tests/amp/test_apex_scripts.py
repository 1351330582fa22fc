"""apex.amp scripts with only the import changed (issue 20): each test is written as a user's script,
after apex's docs and the DeepLearningExamples BERT / ViT-pytorch / GAN training loops, and its numbers
are checked against the native ``overdrive.amp.prepare`` path at a stated tolerance. CPU, bf16."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive import UsageError, amp
from tests.amp.conftest import Net, batch

BF16 = torch.bfloat16


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_torch_save_whole_model_after_initialize(opt_level: str) -> None:
    # apex scripts end with torch.save(model, "model.pt"): the hooks on the model must pickle
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, dtype=BF16)
    x = torch.randn(4, 8)
    with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        # the same casts and autocast run in the loaded copy: bit-identical outputs (tolerance 0)
        assert torch.equal(loaded.eval()(x), model.eval()(x))
    loaded.load_state_dict(model.state_dict())  # its load hooks work, with no optimizer behind them


def _bert_like_script(model: nn.Module, steps: int = 3, accum: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """DeepLearningExamples BERT's run_pretraining.py loop, with only ``from apex import amp`` changed."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic", dtype=BF16)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**10  # args.init_loss_scale
    for step in range(steps):
        for micro in range(accum):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            loss = model(x).float().square().mean() / accum
            with amp.scale_loss(loss, optimizer, delay_overflow_check=False) as scaled_loss:
                scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        for param in optimizer._amp_stash.all_fp32_from_fp16_params:  # DLE BERT's zero_grad
            param.grad = None
        for param in model.parameters():
            param.grad = None
    return model, optimizer


def test_bert_script_loss_scalers_and_amp_stash_match_native() -> None:
    import gc

    gc.collect()  # other tests' runs leave amp._amp_state; a script has only its own
    model, optimizer = _bert_like_script(_mlp())
    scaler = amp._amp_state.loss_scalers[-1]
    assert scaler.loss_scale() == scaler._loss_scale == scaler.cur_scale == 2.0**10 and scaler.dynamic
    stash = optimizer._amp_stash
    assert all(q.dtype == torch.float32 for q in stash.all_fp32_from_fp16_params)
    assert all(q.dtype == BF16 for q in stash.all_fp16_params)
    # the two linear layers are paired with masters; the LayerNorm stays fp32 and is stepped directly
    assert len(stash.all_fp32_from_fp16_params) == 4 and len(stash.all_fp32_from_fp32_params) == 2
    assert {id(q) for q in amp.master_params(optimizer)} == {
        id(q) for q in stash.all_fp32_from_fp16_params + stash.all_fp32_from_fp32_params}

    # the native path, the same steps: bit-identical weights (tolerance 0)
    ref = _mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mp = amp.prepare(ref, opt, amp.Policy(opt_level="O2", dtype=BF16, loss_scale="dynamic"))
    mp.scaler.scale = 2.0**10
    for step in range(3):
        for micro in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            mp.backward(ref(x).float().square().mean() / 2)
        mp.clip_grad_norm_(1.0)
        mp.step()
        mp.zero_grad()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(amp.master_params(optimizer), mp.master_params()):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:.*the loss is inf or NaN")
def test_gan_script_num_losses_and_loss_id_match_native() -> None:
    # apex's DCGAN example: initialize(..., num_losses=3), one loss_id per loss
    def run(apex_surface: bool, overflow_at: int) -> tuple[list[torch.Tensor], list[float]]:
        torch.manual_seed(0)
        net_g, net_d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), nn.Linear(4, 1)
        opt_d = torch.optim.SGD(net_d.parameters(), lr=0.05)
        opt_g = torch.optim.SGD(net_g.parameters(), lr=0.05)
        if apex_surface:
            [net_d, net_g], [opt_d, opt_g] = amp.initialize([net_d, net_g], [opt_d, opt_g], opt_level="O1",
                                                           num_losses=3, loss_scale="dynamic", dtype=BF16)
            scale_loss = amp.scale_loss
        else:
            mp = amp.prepare([net_d, net_g], [opt_d, opt_g], amp.Policy(opt_level="O1", dtype=BF16,
                             loss_scale="dynamic"), num_losses=3)

            def scale_loss(loss, opt, loss_id):  # noqa: ANN001, ANN202
                return mp.scale_loss(loss, [opt], loss_id=loss_id)
        bce = nn.BCEWithLogitsLoss()
        for i in range(4):
            real = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            noise = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + i))
            opt_d.zero_grad()
            err_d_real = bce(net_d(real).float(), torch.ones(8, 1))
            with scale_loss(err_d_real, opt_d, loss_id=0) as scaled:
                scaled.backward()
            fake = net_g(noise)
            err_d_fake = bce(net_d(fake.detach()).float(), torch.zeros(8, 1))
            if i == overflow_at:
                err_d_fake = err_d_fake * float("inf")
            with scale_loss(err_d_fake, opt_d, loss_id=1) as scaled:
                scaled.backward()
            opt_d.step()
            opt_g.zero_grad()
            err_g = bce(net_d(fake).float(), torch.ones(8, 1))
            with scale_loss(err_g, opt_g, loss_id=2) as scaled:
                scaled.backward()
            opt_g.step()
        scales = [s.loss_scale() for s in amp._amp_state.loss_scalers[-3:]] if apex_surface else [
            s.scale for s in mp.scalers]
        return [q.detach().clone() for q in [*net_d.parameters(), *net_g.parameters()]], scales

    params, scales = run(True, overflow_at=1)
    ref, ref_scales = run(False, overflow_at=1)
    assert all(torch.equal(a, b) for a, b in zip(params, ref))  # tolerance 0
    assert scales == ref_scales == [2.0**16, 2.0**15, 2.0**16]  # only loss 1's scaler backed off
    state = amp.state_dict()
    last = sorted(state, key=lambda k: int(k.removeprefix("loss_scaler")))[-3:]
    assert [state[k]["loss_scale"] for k in last] == scales
    amp.load_state_dict(state)
    m = nn.Linear(4, 1)
    m, o = amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1", dtype=BF16)
    with pytest.raises(UsageError, match="loss_id=3 but there are 1 loss scaler"):
        with amp.scale_loss(m(torch.ones(1, 4)).sum(), o, loss_id=3):
            pass


def test_o1_autocast_covers_the_training_step_outside_the_model() -> None:
    # apex O1 patched torch.mm everywhere: a projection and the loss computed after model(x) ran in half
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=BF16)
    proj = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    out = model(x)
    logits = torch.mm(out, proj)  # outside the model, inside the training step
    assert logits.dtype == BF16
    loss = logits.float().square().mean()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert not torch.is_autocast_enabled("cpu")  # backward runs outside the region
        scaled_loss.backward()
    optimizer.step()
    assert not torch.is_autocast_enabled("cpu")
    model.eval()
    with torch.no_grad():  # an eval forward leaves autocast at its end
        out = model(x)  # bf16 values in float32 (numpy has no bfloat16)
        assert torch.equal(out, out.to(BF16).float()) and torch.mm(out, proj).dtype == torch.float32
    model.train()

    # the native path with the whole step under one torch.autocast: the same loss and weights (tolerance 0)
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mp = amp.prepare(ref, opt, amp.Policy(opt_level="O1", dtype=BF16), autocast_hooks=False)
    with mp.autocast():
        ref_loss = torch.mm(ref(x), proj).float().square().mean()
    mp.backward(ref_loss)
    mp.step()
    assert torch.equal(loss, ref_loss)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_o1_region_closes_when_the_forward_raises() -> None:
    model = nn.Linear(4, 2)
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", dtype=BF16)
    with pytest.raises(RuntimeError):
        model(torch.ones(3, 5))
    assert not torch.is_autocast_enabled("cpu")


def test_registered_and_decorated_functions_run_in_their_precision() -> None:
    import types

    # a user's extension module, as apex's docs register `amp.register_float_function(fused_ops, "softmax")`
    fused_ops = types.ModuleType("fused_ops")
    fused_ops.scaled_softmax = lambda x, scale: torch.softmax(x * scale, dim=-1)
    amp.register_float_function(fused_ops, "scaled_softmax")
    amp.register_half_function(torch, "bmm")  # torch.autocast runs bmm in half already: accepted

    @amp.half_function
    def project(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h @ w

    @amp.promote_function
    def mix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("w", torch.randn(8, 8, generator=torch.Generator().manual_seed(3)))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = self.fc(x)  # bf16 under autocast
            return fused_ops.scaled_softmax(h, 0.5), project(h.float(), self.w), mix(h, x)

    torch.manual_seed(0)
    head = Head()
    x = torch.randn(4, 8)
    head, _ = amp.initialize(head, torch.optim.SGD(head.parameters(), lr=0.1), opt_level="O1", dtype=BF16)
    with torch.no_grad():
        probs, proj, mixed = head(x)
    # the model's bf16 outputs come back in float32 (numpy has no bfloat16): proj holds bf16 values
    assert probs.dtype == proj.dtype == mixed.dtype == torch.float32 and torch.equal(proj, proj.to(BF16).float())
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        h16 = head.fc(x)  # the activations the functions got: bf16, from autocast's linear
    # the fp32 softmax of the bf16 activations: fp32 rounding only (atol 1e-6)
    torch.testing.assert_close(probs, torch.softmax(h16.float() * 0.5, dim=-1), atol=1e-6, rtol=0)
    # bf16 matmul against the fp32 one: bf16's 8 significant bits (rtol 2e-2, atol 5e-2)
    torch.testing.assert_close(proj.float(), h16.float() @ head.w, rtol=2e-2, atol=5e-2)
    assert fused_ops.scaled_softmax(h16, 0.5).dtype == BF16  # outside autocast: the function as it was


def test_register_float_function_on_torch_runs_it_in_fp32_under_o1(monkeypatch: pytest.MonkeyPatch) -> None:
    """``amp.register_float_function(torch, "sigmoid")`` before O1 (classifier and detection repos, into BCELoss) was
    refused, since overdrive never patches torch. O1's region now casts the registered function's calls through a
    TorchFunctionMode. Reference: the same sigmoid in fp32 on the bf16 activations (exact); outside O1, and for
    ``Tensor.sigmoid`` (not the registered object, as under apex), nothing changes."""
    from overdrive.amp import functions

    monkeypatch.setattr(functions, "TORCH_REGISTERED", {})
    seen: dict[str, torch.dtype] = {}

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc(x)
            p = torch.sigmoid(h)
            seen.update(h=h.dtype, p=p.dtype, method=h.sigmoid().dtype)
            return p, h

    amp.register_float_function(torch, "sigmoid")
    torch.manual_seed(0)
    head = Head()
    head, opt = amp.initialize(head, torch.optim.SGD(head.parameters(), lr=0.1), opt_level="O1", dtype=BF16)
    x = torch.randn(4, 8)
    p, h = head(x)
    assert seen == {"h": BF16, "p": torch.float32, "method": BF16}
    torch.testing.assert_close(p, torch.sigmoid(h.to(BF16).float()), rtol=0, atol=0)
    with amp.scale_loss(nn.functional.binary_cross_entropy(p, torch.ones_like(p)), opt) as scaled:
        scaled.backward()  # the mode left with the region: backward and the step run outside it
    opt.step()
    assert not torch.is_autocast_enabled("cpu")
    assert torch.sigmoid(torch.ones(2, dtype=BF16)).dtype == BF16  # outside O1's region: torch as it is
