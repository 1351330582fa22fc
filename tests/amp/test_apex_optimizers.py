"""apex.parallel.LARC and apex.optimizers' FusedAdagrad, FusedNovoGrad and FusedMixedPrecisionLamb: each
checked against apex's arithmetic written out here in float64 (from apex's Python and CUDA sources), with the
same gradients replayed, to fp32 tolerance (rtol 1e-5 unless stated)."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

from overdrive import UsageError, amp
from overdrive.apex.optimizers import FusedAdagrad, FusedMixedPrecisionLamb, FusedNovoGrad
from overdrive.apex.parallel import LARC


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def _run(model: nn.Module, opt: torch.optim.Optimizer, n: int = 4, scale: float = 1.0) -> list[list[torch.Tensor]]:
    """n steps on fixed batches; the gradients each step applied (read before the step)."""
    grads = []
    for i in range(n):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).to(next(model.parameters()).dtype)
        (model(x).square().mean() * scale).backward()
        grads.append([p.grad.detach().double().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


def _close(model: nn.Module, ref: list[torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=rtol, atol=atol)


# --- LARC ---------------------------------------------------------------------------------------------
def _larc_sgd_reference(w0: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, wd: float, tc: float,
                        clip: bool, momentum: float, eps: float = 1e-8) -> list[torch.Tensor]:
    """apex's LARC.step over torch's SGD (weight decay moved into the gradient), in float64."""
    w = [x.double().clone() for x in w0]
    buf: list[torch.Tensor | None] = [None] * len(w)
    for gs in grads:
        for i, g in enumerate(gs):
            wn, gn = w[i].norm(), g.norm()
            if wn != 0 and gn != 0:
                local = tc * wn / (gn + wn * wd + eps)
                if clip:
                    local = min(local / lr, 1.0)
                g = (g + wd * w[i]) * local
            buf[i] = g.clone() if buf[i] is None else momentum * buf[i] + g
            w[i] = w[i] - lr * buf[i]
    return w


@pytest.mark.parametrize("clip", [False, True])
def test_larc_matches_apex_in_float64(clip: bool) -> None:
    model = _model()
    w0 = [p.detach().clone() for p in model.parameters()]
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt = LARC(optimizer=base, trust_coefficient=0.001 if not clip else 0.02, clip=clip)
    grads = _run(model, opt)
    assert base.param_groups[0]["weight_decay"] == 1e-4  # put back after each step
    _close(model, _larc_sgd_reference(w0, grads, 0.1, 1e-4, 0.001 if not clip else 0.02, clip, 0.9))


def test_larc_leaves_zero_norm_parameters_and_their_decay_alone() -> None:
    w, z = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.ones(3))
    opt = LARC(torch.optim.SGD([w, z], lr=1.0, weight_decay=0.5), trust_coefficient=0.02, clip=False)
    w.grad, z.grad = torch.ones(3), torch.zeros(3)
    opt.step()
    # apex: no local rate and no decay where ||w|| or ||grad|| is 0; the inner SGD ran with weight_decay 0
    torch.testing.assert_close(w.detach(), -torch.ones(3))
    torch.testing.assert_close(z.detach(), torch.ones(3))


def test_larc_exposes_the_wrapped_optimizer_and_round_trips() -> None:
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = LARC(base, trust_coefficient=0.001, clip=False)
    assert opt.param_groups is base.param_groups and opt.state is base.state
    _run(model, opt, n=2)
    sd = opt.state_dict()
    assert sd.keys() == base.state_dict().keys() and len(sd["state"]) == 4
    fresh = LARC(torch.optim.SGD(_model(1).parameters(), lr=0.5, momentum=0.9), trust_coefficient=0.001)
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["lr"] == 0.1 and fresh.state is fresh.optim.state and len(fresh.state) == 4
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert isinstance(clone, LARC) and clone.trust_coefficient == 0.001 and clone.clip is False
        assert clone.optim is not base and clone.param_groups is clone.optim.param_groups
    opt.__setstate__(base.__getstate__())  # apex forwarded a state of the wrapped optimizer
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _run(model, opt, n=1)
    sched.step()
    assert base.param_groups[0]["lr"] == 0.05
    with pytest.raises(UsageError, match="wraps a torch.optim.Optimizer"):
        LARC(object())


def test_larc_step_hooks_run_once_around_the_wrapped_step() -> None:
    model = _model()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1), trust_coefficient=0.02)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    _run(model, opt, n=2)
    assert calls == ["pre", "post"] * 2


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_larc_under_amp_initialize(opt_level: str) -> None:
    """amp.initialize takes a LARC-wrapped optimizer: the loss is scaled and unscaled, LARC sees the true
    gradients (the same steps as an fp32 run, to bf16 tolerance), O2 steps the fp32 masters."""
    ref, model = _model(), _model()
    ref_opt = LARC(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), trust_coefficient=0.02)
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), trust_coefficient=0.02)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    for i in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    masters = list(amp.master_params(opt))
    assert all(q.dtype == torch.float32 for q in masters)
    for q, r in zip(masters, ref.parameters()):
        torch.testing.assert_close(q.detach(), r.detach(), rtol=0.02, atol=2e-3)  # bf16 forward and backward


def test_larc_under_amp_skips_an_overflowing_step() -> None:
    model = _model()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1), trust_coefficient=0.02)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 8)
    with amp.scale_loss(model(x).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


# --- FusedAdagrad -------------------------------------------------------------------------------------
def _adagrad_reference(w0: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, wd: float, eps: float,
                       w_mode: bool) -> list[torch.Tensor]:
    """apex's multi_tensor_adagrad kernel (mode 0: L2, mode 1: decoupled), in float64."""
    w = [x.double().clone() for x in w0]
    h = [torch.zeros_like(x) for x in w]
    for gs in grads:
        for i, g in enumerate(gs):
            if not w_mode:
                g = g + wd * w[i]
                h[i] = h[i] + g * g
                w[i] = w[i] - lr * (g / (h[i].sqrt() + eps))
            else:
                h[i] = h[i] + g * g
                w[i] = w[i] - lr * (g / (h[i].sqrt() + eps) + wd * w[i])
    return w


@pytest.mark.parametrize("w_mode", [False, True])
def test_fused_adagrad_matches_apex_in_float64(w_mode: bool) -> None:
    model = _model()
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = FusedAdagrad(model.parameters(), lr=0.05, weight_decay=0.1, adagrad_w_mode=w_mode)
    assert isinstance(opt, torch.optim.Adagrad) and not opt.state  # state at the first step, as apex
    grads = _run(model, opt)
    assert opt.param_groups[0]["weight_decay"] == 0.1 and set(opt.state[next(model.parameters())]) == {"step", "sum"}
    _close(model, _adagrad_reference(w0, grads, 0.05, 0.1, 1e-10, w_mode))


def test_fused_adagrad_runs_its_step_hooks_once_and_takes_amp() -> None:
    torch.optim.Adagrad([nn.Parameter(torch.ones(1))])  # torch now wraps Adagrad.step with the hooks too
    model = _model()
    opt = FusedAdagrad(model.parameters(), lr=0.05, weight_decay=0.1, adagrad_w_mode=True)
    calls: list[int] = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)  # torch's Adagrad has state: refused
    x = torch.randn(5, 8)
    with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert calls == [1] and all(q.dtype == torch.float32 for q in amp.master_params(opt))


# --- FusedNovoGrad ------------------------------------------------------------------------------------
def _novograd_reference(w0: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, wd: float,
                        b1: float = 0.95, b2: float = 0.98, eps: float = 1e-8, reg_inside_moment: bool = False,
                        grad_averaging: bool = True, norm_type: int = 2, init_zero: bool = False,
                        bias_correction: bool = True) -> list[torch.Tensor]:
    """apex's FusedNovoGrad (multi_tensor_novograd and the norm blend of multi_tensor_norm_out), in float64."""
    w = [x.double().clone() for x in w0]
    m = [torch.zeros_like(x) for x in w]
    v: list[torch.Tensor | None] = [None] * len(w)
    b3 = 1 - b1 if grad_averaging else 1.0
    for t, gs in enumerate(grads, start=1):
        c1 = 1 - b1**t if bias_correction else 1.0
        c2 = math.sqrt(1 - b2**t) if bias_correction else 1.0
        for i, g in enumerate(gs):
            n = g.norm() if norm_type == 2 else g.abs().max()
            if v[i] is None:
                v[i] = torch.zeros_like(n) if init_zero else n
            v[i] = (b2 * v[i] ** 2 + (1 - b2) * n**2).sqrt() if norm_type == 2 else b2 * v[i] + (1 - b2) * n
            denom = v[i] / c2 + eps
            if reg_inside_moment:
                m[i] = b1 * m[i] + b3 * (g / denom + wd * w[i])
                w[i] = w[i] - lr * m[i] / c1
            else:
                m[i] = b1 * m[i] + b3 * g
                w[i] = w[i] - lr * ((m[i] / c1) / denom + wd * w[i])
    return w


NOVOGRAD_CASES = [
    {},  # apex's defaults, Jasper's betas
    {"reg_inside_moment": True},
    {"norm_type": 0, "init_zero": True},
    {"grad_averaging": False, "bias_correction": False},
]


@pytest.mark.parametrize("kw", NOVOGRAD_CASES, ids=lambda kw: "-".join(kw) or "defaults")
def test_fused_novograd_matches_apex_in_float64(kw: dict) -> None:
    model = _model()
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = FusedNovoGrad(model.parameters(), lr=0.01, betas=(0.95, 0.98), weight_decay=0.001, **kw)
    grads = _run(model, opt)
    assert opt.param_groups[0]["step"] == 4
    _close(model, _novograd_reference(w0, grads, 0.01, 0.001, **kw))


def test_fused_novograd_refuses_what_apex_refused() -> None:
    params = _model().parameters()
    with pytest.raises(UsageError, match="amsgrad"):
        FusedNovoGrad(params, amsgrad=True)
    with pytest.raises(UsageError, match="norm_type=1"):
        FusedNovoGrad(_model().parameters(), norm_type=1)


# --- FusedMixedPrecisionLamb --------------------------------------------------------------------------
def _lamb_reference(w0: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, wd: float,
                    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, max_norm: float = 1.0,
                    inv_scale: float = 1.0) -> list[torch.Tensor]:
    """apex's multi_tensor_lamb_mp (adam_w_mode, grad averaging, bias correction; gradients unscaled by
    ``inv_scale``, the global norm compared with max_norm), in float64, on fp32 masters."""
    w = [x.double().clone() for x in w0]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, grads_t in enumerate(grads, start=1):
        gs = [g * inv_scale for g in grads_t]
        norm = torch.sqrt(sum((g * g).sum() for g in gs))
        gs = [g / (norm / max_norm) if norm > max_norm else g for g in gs]
        for i, g in enumerate(gs):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps) + wd * w[i]
            r = w[i].norm() / u.norm() if w[i].norm() > 0 and u.norm() > 0 else 1.0
            w[i] = w[i] - lr * r * u
    return w


def test_mixed_precision_lamb_keeps_fp32_masters_of_bf16_weights() -> None:
    model = _model(dtype=torch.bfloat16)
    w0 = [p.detach().float() for p in model.parameters()]
    opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2, weight_decay=0.01,
                                  reduced_precision_dtype=torch.bfloat16)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and opt.param_groups[0]["step"].tolist() == [0]
    grads = _run(model, opt, scale=10.0)  # * 10: the global norm exceeds max_grad_norm, so it clips
    ref = _lamb_reference(w0, grads, 1e-2, 0.01)
    for p, r in zip(model.parameters(), ref):
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["master_param"].dtype == torch.float32
        # the masters follow the float64 reference (fp32 arithmetic), the weights are the masters rounded
        torch.testing.assert_close(state["master_param"].double(), r, rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), state["master_param"].to(torch.bfloat16))
    assert opt.param_groups[0]["step"].tolist() == [4]


def test_mixed_precision_lamb_checkpoint_keeps_fp32_state() -> None:
    model = _model(dtype=torch.bfloat16)
    opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    _run(model, opt, n=2)
    twin = _model(dtype=torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    opt2 = FusedMixedPrecisionLamb(twin.parameters(), lr=0.5, reduced_precision_dtype=torch.bfloat16)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    p2 = next(twin.parameters())
    assert opt2.state[p2]["exp_avg"].dtype == opt2.state[p2]["master_param"].dtype == torch.float32
    assert float(opt2.param_groups[0]["lr"]) == pytest.approx(1e-2)
    _run(model, opt, n=1)
    _run(twin, opt2, n=1)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])


def test_mixed_precision_lamb_with_torch_grad_scaler() -> None:
    """scaler.step(opt) hands over grad_scale / found_inf: the step unscales, and skips whole on inf."""
    model = _model()
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    grads = []
    for i in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean() * 10
        scaler.scale(loss).backward()
        grads.append([p.grad.detach().double().clone() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    _close(model, _lamb_reference(w0, grads, 1e-2, 0.01, inv_scale=1 / 1024.0))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(5, 8)).sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert opt.param_groups[0]["step"].tolist() == [3] and scaler.get_scale() == 512.0
