"""overdrive.amp numerics on CPU (bf16): dtypes per level, masters, scaler, clipping, state, accumulation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import UsageError, amp
from overdrive.amp import Policy, prepare

from .conftest import Net, batch


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed0: int = 0) -> list[float]:
    losses = []
    for i in range(steps):
        x, y = batch(seed=seed0 + i)
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_param_and_buffer_dtypes_per_level(net: Net, level: str) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = amp.initialize(net, opt, opt_level=level, dtype=torch.bfloat16)
    half = torch.bfloat16
    want_conv = half if level in ("O2", "O3") else torch.float32
    want_norm = torch.float32 if level in ("O0", "O1", "O2") else half
    assert model.conv.weight.dtype == want_conv and model.fc.weight.dtype == want_conv
    assert model.bn.weight.dtype == want_norm and model.bn.running_mean.dtype == want_norm
    assert model.ln.weight.dtype == want_norm
    out = model(batch()[0])
    # O2/O3 hand back float outputs (apex); O1's would be what autocast makes of the last op, but in bfloat16
    # (which numpy cannot hold) they come back in float32
    assert out.dtype == torch.float32


def test_o1_bf16_outputs_reach_numpy(net: Net) -> None:
    """Hugging Face's run_glue evaluation with --fp16: ``logits.detach().cpu().numpy()``. apex's O1 gave fp16 logits;
    O1 in bfloat16 (the CPU's default) gave bf16 ones and numpy raised "Got unsupported ScalarType BFloat16".
    The last layer still computed in bf16; an explicit cast_model_outputs is honoured."""
    seen = {}
    net.fc.register_forward_hook(lambda m, i, o: seen.update(dtype=o.dtype))
    model, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O1", dtype=torch.bfloat16)
    assert model(batch()[0]).detach().numpy().dtype.name == "float32" and seen["dtype"] == torch.bfloat16
    other = Net()
    other, _ = amp.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), opt_level="O1",
                              dtype=torch.bfloat16, cast_model_outputs=torch.bfloat16)
    assert other(batch()[0]).dtype == torch.bfloat16


def test_o1_forward_runs_under_autocast(net: Net) -> None:
    seen = {}
    net.fc.register_forward_hook(lambda m, i, o: seen.setdefault("dtype", o.dtype))
    model, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O1", dtype=torch.bfloat16)
    model(batch()[0])
    assert seen["dtype"] == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")  # the exit hook restored the state


def test_o1_autocast_is_restored_when_forward_raises(net: Net) -> None:
    model, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O1", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 6, 6))  # wrong channel count
    assert not torch.is_autocast_enabled("cpu")


def test_o2_masters_are_fp32_and_model_is_refreshed_after_step(net: Net) -> None:
    originals = list(net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = amp.initialize(net, opt, opt_level="O2", dtype=torch.bfloat16)
    masters = list(amp.master_params(opt))
    assert [id(m) for m in masters] == [id(p) for p in originals]  # the optimizer keeps the fp32 objects
    assert all(m.dtype == torch.float32 for m in masters)
    before = [m.detach().clone() for m in masters]
    _train(model, opt, steps=2)
    assert any(not torch.equal(b, m) for b, m in zip(before, masters))  # masters moved
    by_id = {id(m): m for m in masters}
    mp = amp.apex._lookup(opt)
    for half, master in mp._pairs:
        assert half.dtype == torch.bfloat16 and id(master) in by_id
        assert torch.equal(half.detach(), master.detach().to(torch.bfloat16))
        assert half.grad is None and master.grad is None  # grads consumed by the step


def test_o2_keeps_tied_weights_tied() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16)
    assert model[0].weight is model[1].weight
    assert len(list(amp.master_params(opt))) == 1


def test_scaler_growth_backoff_cap_and_floor() -> None:
    s = amp.LossScaler(dynamic=True, init_scale=8.0, growth_interval=3, min_scale=2.0, max_scale=32.0)
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 16.0
    for _ in range(6):
        s.update(found_inf=False)
    assert s.scale == 32.0  # capped
    for _ in range(5):
        s.update(found_inf=True)
    assert s.scale == 2.0  # floored
    assert s.overflows == 5 and s.unskipped == 0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_injected_inf_skips_the_step_and_backs_off(net: Net, level: str) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(net, opt, opt_level=level, dtype=torch.bfloat16, loss_scale="dynamic")
    mp = amp.apex._lookup(opt)
    _train(model, opt, steps=1)
    state_before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    masters_before = [m.detach().clone() for m in amp.master_params(opt)]
    scale0 = mp.loss_scale
    handle = model.fc.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    x, y = batch(seed=5)
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    handle.remove()
    assert mp.loss_scale == scale0 / 2
    assert mp.scaler.overflows == 1
    for m, b in zip(amp.master_params(opt), masters_before):
        assert torch.equal(m, b)
    for k, v in model.state_dict().items():
        if "running" not in k and "num_batches" not in k:  # BN stats update in forward, as in apex
            assert torch.equal(v, state_before[k]), k
    _train(model, opt, steps=1, seed0=7)  # and training goes on
    assert any(not torch.equal(m, b) for m, b in zip(amp.master_params(opt), masters_before))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_master_grads_are_unscaled_and_clipping_matches_reference(net: Net, level: str) -> None:
    ref = copy.deepcopy(net)
    x, y = batch()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = amp.initialize(net, opt, opt_level=level, dtype=torch.bfloat16, loss_scale=1024.0)
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    grads = [p.grad for p in amp.master_params(opt)]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
    # bf16 forward/backward vs fp32 reference: relative error of a few bf16 ulps
    assert abs(norm.item() - ref_norm.item()) / ref_norm.item() < 3e-2
    clipped = torch.sqrt(sum(g.float().pow(2).sum() for g in grads))
    assert clipped.item() == pytest.approx(0.5, rel=1e-3)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_gradient_accumulation_equals_large_batch(level: str) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    mpa = prepare(a, oa, Policy(opt_level=level, dtype=torch.bfloat16, loss_scale=256.0))
    mpb = prepare(b, ob, Policy(opt_level=level, dtype=torch.bfloat16, loss_scale=256.0))
    with mpa.autocast():
        mpa.backward(nn.functional.cross_entropy(a(x), y))
    for i in (0, 4):
        with mpb.autocast():
            mpb.backward(nn.functional.cross_entropy(b(x[i:i + 4]), y[i:i + 4]) / 2)
    ga = [p.grad for p in mpa.master_params()]
    gb = [p.grad for p in mpb.master_params()]
    for u, v in zip(ga, gb):
        # the same sum in another order and batch split, in bf16: a few ulps of bf16
        torch.testing.assert_close(u.float(), v.float(), atol=2e-2, rtol=5e-2)


@pytest.mark.parametrize("opt_kwargs", [{"foreach": True}, {"foreach": False}, {"fused": True}])
def test_works_with_foreach_and_fused_optimizers(net: Net, opt_kwargs: dict) -> None:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, **opt_kwargs)
    model, opt = amp.initialize(net, opt, opt_level="O2", dtype=torch.bfloat16)
    losses = _train(model, opt, steps=12)
    assert losses[-1] < losses[0]


def test_two_models_in_one_process_do_not_interfere() -> None:
    torch.manual_seed(0)
    m1, m2 = Net(), Net()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    m1, o1 = amp.initialize(m1, o1, opt_level="O2", dtype=torch.bfloat16, loss_scale="dynamic")
    m2, o2 = amp.initialize(m2, o2, opt_level="O1", dtype=torch.bfloat16)
    h = m1.fc.weight.register_hook(lambda g: g * float("inf"))
    _train(m1, o1, steps=1)
    h.remove()
    _train(m2, o2, steps=1)
    s1, s2 = amp.apex._lookup(o1), amp.apex._lookup(o2)
    assert s1.scaler.overflows == 1 and s2.scaler.overflows == 0
    assert s1.policy.opt_level == "O2" and s2.policy.opt_level == "O1"
    assert m2.fc.weight.dtype == torch.float32


def test_scale_loss_with_an_uninitialized_optimizer(net: Net) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="never saw"):
        with amp.scale_loss(net(batch()[0]).sum(), opt):
            pass


def test_loading_state_from_another_opt_level(net: Net) -> None:
    """A resume with another ``--opt-level`` (apex loads it: its state is the loss scale only) used to raise. The
    saved dynamic scale carries over to a dynamic scaler; the O2 masters come from the model's weights."""
    cuda_like = Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic")
    mp1 = prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), cuda_like)
    mp1.scaler.scale, mp1.scaler.unskipped = 512.0, 7
    other = Net()
    mp2 = prepare(other, torch.optim.SGD(other.parameters(), lr=0.1),
                  Policy(opt_level="O2", dtype=torch.bfloat16, loss_scale="dynamic"))
    mp2.load_state_dict(mp1.state_dict())
    assert (mp2.scaler.scale, mp2.scaler.unskipped) == (512.0, 7)
    static = Net()
    mp3 = prepare(static, torch.optim.SGD(static.parameters(), lr=0.1), Policy(opt_level="O3", dtype=torch.bfloat16))
    mp3.load_state_dict(mp2.state_dict())  # a static scale belongs to this run's policy: kept
    assert mp3.scaler.scale == 1.0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_state_round_trip_resumes_bit_identically(level: str) -> None:
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = Net()
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return amp.initialize(m, o, opt_level=level, dtype=torch.bfloat16, loss_scale="dynamic")

    # the scaler grows every 2 steps so its state matters
    import overdrive.amp.apex as apex_mod

    ref_m, ref_o = fresh()
    apex_mod._lookup(ref_o).scaler.growth_interval = 2
    _train(ref_m, ref_o, steps=6)
    ref_state = {k: v.clone() for k, v in ref_m.state_dict().items()}

    m, o = fresh()
    apex_mod._lookup(o).scaler.growth_interval = 2
    _train(m, o, steps=3)
    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": o.state_dict(), "amp": apex_mod._lookup(o).state_dict()})
    m2, o2 = fresh()
    apex_mod._lookup(o2).scaler.growth_interval = 2
    m2.load_state_dict(ckpt["model"])
    o2.load_state_dict(ckpt["opt"])
    apex_mod._lookup(o2).load_state_dict(ckpt["amp"])
    _train(m2, o2, steps=3, seed0=3)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, ref_state[k]), k
    assert apex_mod._lookup(o2).loss_scale == apex_mod._lookup(ref_o).loss_scale


def test_apex_state_dict_names_and_load(net: Net) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = amp.initialize(net, opt, opt_level="O2", dtype=torch.bfloat16, loss_scale="dynamic")
    state = amp.state_dict()
    key = [k for k in state if k.startswith("loss_scaler")][-1]
    assert state[key]["loss_scaler"]["loss_scale"] == 2.0**16


def test_torch_compile_o2_matches_eager(net: Net) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mp = prepare(net, opt, Policy(opt_level="O2", dtype=torch.bfloat16))
    net.eval()
    x = batch()[0]
    eager = net(x)
    compiled = torch.compile(net)(x)
    assert compiled.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=2e-2)  # bf16 kernels may differ by an ulp
    assert mp.policy.opt_level == "O2"


def test_o1_apex_hooks_work_under_torch_compile() -> None:
    # the autocast hooks used to be traced by Dynamo and failed ("'autocast' object has no attribute 'prev'")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp.initialize(m, opt, opt_level="O1", dtype=torch.bfloat16)
    x = torch.randn(4, 8)
    eager = m(x)
    out = torch.compile(m)(x)
    # ran under autocast: bf16 values, handed back in float32 (numpy has no bfloat16)
    assert out.dtype == torch.float32 and torch.equal(out, out.bfloat16().float())
    torch.testing.assert_close(out, eager)
    # the apex surface keeps O1's autocast on for the training step, while its outputs are alive
    assert torch.is_autocast_enabled("cpu")
    with amp.scale_loss(out.float().sum(), opt) as scaled:
        assert not torch.is_autocast_enabled("cpu")  # until scale_loss
        scaled.backward()
    opt.step()


# --- regressions -------------------------------------------------------------------------------


@pytest.mark.parametrize("through_parent", [False, True])
def test_o2_model_load_state_dict_after_prepare_updates_the_masters(net: Net, through_parent: bool) -> None:
    # the masters kept the pre-load weights and the first step copied them back over the loaded ones
    torch.manual_seed(1)
    pretrained = Net().state_dict()  # fp32
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # lr=0: a step must leave the loaded weights as they are
    mp = prepare(net, opt, Policy(opt_level="O2", dtype=torch.bfloat16))
    if through_parent:  # the prepared model is a submodule: its keys carry a prefix
        nn.ModuleDict({"body": net}).load_state_dict({f"body.{k}": v for k, v in pretrained.items()})
    else:
        net.load_state_dict(pretrained)
    masters = {id(m): m for m in mp.master_params()}
    names = dict(net.named_parameters())
    for name, value in pretrained.items():
        if name in names:
            q = names[name]
            master = next((m for h, m in mp._pairs if h is q), q)  # norm layers are their own master
            assert id(master) in masters
            assert torch.equal(master, value), name  # exact: the checkpoint's fp32, not its bf16 rounding
    with mp.autocast():
        mp.backward(nn.functional.cross_entropy(net(batch()[0]), batch()[1]))
    mp.step()
    for name, q in names.items():
        # plain-PyTorch reference: the fp32 checkpoint rounded to the model's dtype, exactly
        assert torch.equal(q.detach(), pretrained[name].to(q.dtype)), name


def test_o2_amp_state_then_model_state_keeps_the_fp32_masters(net: Net) -> None:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    mp = prepare(net, opt, Policy(opt_level="O2", dtype=torch.bfloat16))
    for i in range(2):
        x, y = batch(seed=i)
        with mp.autocast():
            mp.backward(nn.functional.cross_entropy(net(x), y))
        mp.step()
        mp.zero_grad()
    model_state = copy.deepcopy(net.state_dict())  # bf16 weights
    amp_state = copy.deepcopy(mp.state_dict())  # fp32 masters
    ref_masters = [m.detach().clone() for m in mp.master_params()]

    torch.manual_seed(3)
    other = Net()
    mp2 = prepare(other, torch.optim.AdamW(other.parameters(), lr=1e-2), Policy(opt_level="O2", dtype=torch.bfloat16))
    mp2.load_state_dict(amp_state)  # amp first, then the model's own bf16 state: the fp32 masters survive
    other.load_state_dict(model_state)
    for m, ref in zip(mp2.master_params(), ref_masters):
        assert torch.equal(m, ref)

    with pytest.raises(UsageError, match="assign=True"):
        other.load_state_dict(model_state, assign=True)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("outputs", [torch.float32, torch.bfloat16])
def test_cast_model_outputs_applies_at_every_opt_level(level: str, outputs: torch.dtype) -> None:
    # apex casts outputs whenever cast_model_outputs is given; O0/O1 ignored it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, dtype=torch.bfloat16, cast_model_outputs=outputs)
    x = torch.randn(4, 6)
    out = model(x)
    assert out.dtype == outputs
    if level in ("O0", "O1"):
        # plain-PyTorch reference (fp32, or under autocast for O1) cast afterwards: bit-identical
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=level == "O1"):
            expected = ref(x)
        assert torch.equal(out, expected.to(outputs))


def test_o0_state_moves_between_cuda_and_cpu() -> None:
    # O0 uses no half dtype, but the state recorded the device's default (float16 on CUDA) and the
    # CPU run (bfloat16) refused it
    m = nn.Linear(4, 2)
    # O0 records no half dtype on any device, so this is the state a CUDA O0 run writes too
    cuda_state = prepare(m, torch.optim.SGD(m.parameters(), lr=0.1), "O0").state_dict()
    old_state = {**cuda_state, "dtype": "float16"}  # as written before the fix
    m2 = nn.Linear(4, 2)
    cpu_mp = prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1), "O0")
    cpu_mp.load_state_dict(cuda_state)
    cpu_mp.load_state_dict(old_state)
    # a CUDA fp16 run resumed in bf16: the dynamic scale carries over (as apex's own state would), nothing raises
    m3 = nn.Linear(4, 2)
    o1 = prepare(m3, torch.optim.SGD(m3.parameters(), lr=0.1),
                 Policy(opt_level="O1", dtype=torch.bfloat16, loss_scale="dynamic"))
    saved = o1.state_dict()
    o1.load_state_dict({**saved, "dtype": "float16", "loss_scaler": {**saved["loss_scaler"], "loss_scale": 1024.0}})
    assert o1.scaler.scale == 1024.0


def test_initialize_keeps_no_model_or_optimizer_alive() -> None:
    import gc
    import weakref

    m = nn.Linear(4, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level="O2", dtype=torch.bfloat16)
    refs = [weakref.ref(m), weakref.ref(o)]
    del m, o
    gc.collect()
    assert all(r() is None for r in refs)


def test_apex_resume_recipe_in_the_same_process() -> None:
    # apex's recipe: save amp.state_dict(), drop the run, rebuild, initialize, load. The dropped
    # run's handle used to stay registered, so the counts never matched.
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = nn.Linear(4, 2)
        return amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1", dtype=torch.bfloat16,
                              loss_scale="dynamic")

    model, opt = build()
    saved = copy.deepcopy(amp.state_dict())
    mine = max(saved, key=lambda k: int(k.removeprefix("loss_scaler")))  # the latest initialize call
    saved[mine]["loss_scaler"]["loss_scale"] = 1024.0
    del model, opt  # no gc.collect(): amp.state_dict/load_state_dict must not see the old run
    model, opt = build()
    assert sorted(amp.state_dict()) == sorted(saved)
    amp.load_state_dict(saved)
    assert amp.state_dict()[mine]["loss_scaler"]["loss_scale"] == 1024.0


def test_load_a_checkpoint_written_by_apex() -> None:
    # apex/amp/frontend.py writes {'loss_scaler<i>': {'loss_scale', 'unskipped'}}: no opt level
    m = nn.Linear(4, 2)
    m, o = amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1", dtype=torch.bfloat16,
                          loss_scale="dynamic")
    state = amp.state_dict()
    mine = max(state, key=lambda k: int(k.removeprefix("loss_scaler")))  # the latest initialize call
    state[mine] = {"loss_scale": 32768.0, "unskipped": 517}
    amp.load_state_dict(state)
    mp = amp.apex._lookup(o)
    assert (mp.loss_scale, mp.scaler.unskipped) == (32768.0, 517)
    # a static scale (bf16 needs none) is this run's policy: an apex entry leaves it alone
    m2 = nn.Linear(4, 2)
    static = prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1), Policy(opt_level="O2", dtype=torch.bfloat16))
    static.load_state_dict({"loss_scale": 32768.0, "unskipped": 517})
    assert static.loss_scale == 1.0
    with pytest.raises(UsageError, match="'unskipped'"):
        mp.load_state_dict({"loss_scale": 8.0})
