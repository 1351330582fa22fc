"""``overdrive.apex``: apex's import paths, one changed line each (issue 20), with the numbers checked
against torch's own optimizers and DDP, and a float64 LAMB written out here."""

from __future__ import annotations

import datetime
import gc

import pytest
import torch
from torch import nn

from overdrive import UsageError


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> None:
    for i in range(n):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_the_apex_imports_are_one_changed_line_each() -> None:
    from overdrive import amp as native_amp
    from overdrive.apex import amp
    from overdrive.apex.contrib.sparsity import ASP
    from overdrive.apex.fp16_utils import to_python_float
    from overdrive.apex.optimizers import FusedAdam, FusedLAMB  # noqa: F401
    from overdrive.apex.parallel import DistributedDataParallel  # noqa: F401
    from overdrive.sparsity import ASP as NativeASP

    assert amp is native_amp and ASP is NativeASP
    assert to_python_float(torch.tensor([2.5])) == 2.5 and to_python_float(3) == 3.0


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_torch_adam(adam_w_mode: bool) -> None:
    from overdrive.apex.optimizers import FusedAdam

    a, b = _model(), _model()
    opt = FusedAdam(a.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["fused"]
    ref = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(b.parameters(), lr=1e-2, weight_decay=0.1,
                                                                  foreach=False)
    _steps(a, opt)
    _steps(b, ref)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # fused vs the for-loop kernel: fp32 rounding
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys()


def _adam_uncorrected_reference(params: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]], lr: float,
                                wd: float, adam_w_mode: bool, b1: float = 0.9, b2: float = 0.999,
                                eps: float = 1e-8) -> list[torch.Tensor]:
    """apex's FusedAdam with bias_correction=False, in float64, written out (apex's multi_tensor_adam kernel with
    bias_correction1 = bias_correction2 = 1)."""
    w = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            g = g.double()
            if not adam_w_mode:
                g = g + wd * w[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = m[i] / (v[i].sqrt() + eps)
            if adam_w_mode:
                u = u + wd * w[i]
            w[i] = w[i] - lr * u
    return w


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_without_bias_correction_matches_a_float64_reference(adam_w_mode: bool) -> None:
    """``FusedAdam(bias_correction=False)`` (DeepLearningExamples' BERT run_squad/run_glue) was refused. Reference:
    apex's update written out in float64; tolerance fp32 rounding over 4 steps. Its first step moves each weight by
    lr * (1 - b1) / sqrt(1 - b2) ~ 3.2 lr, where a bias-corrected step moves it by ~lr: the two cannot pass for
    each other."""
    from overdrive.apex.optimizers import FusedAdam

    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, bias_correction=False, adam_w_mode=adam_w_mode)
    seen: list[list[torch.Tensor]] = []
    for i in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        seen.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    ref = _adam_uncorrected_reference(start, seen, 1e-2, 0.1, adam_w_mode)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
    st = opt.state[next(model.parameters())]  # torch's Adam layout: a checkpoint loads into torch.optim.Adam
    assert float(st["step"]) == 4 and {"exp_avg", "exp_avg_sq"} <= st.keys()
    torch.optim.Adam(_model().parameters()).load_state_dict(opt.state_dict())


def test_fused_adam_groups_mix_bias_correction_and_skip_params_without_grads() -> None:
    """A param group may turn bias correction off on its own; a parameter without a gradient (an amp skipped step,
    a frozen layer) is left as it is, its state not made."""
    from overdrive.apex.optimizers import FusedAdam

    a, b = _model(), _model()
    opt = FusedAdam([{"params": a[0].parameters(), "bias_correction": False}, {"params": a[2].parameters()}],
                    lr=1e-2)
    # the reference: each group stepped by its own optimizer (the uncorrected one checked against float64 above)
    refs = [FusedAdam([b[0].bias], lr=1e-2, bias_correction=False),
            torch.optim.AdamW(b[2].parameters(), lr=1e-2, weight_decay=0.0, foreach=False)]
    a[0].weight.requires_grad_(False)
    b[0].weight.requires_grad_(False)
    _steps(a, opt)
    for i in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        b(x).square().mean().backward()
        for r in refs:
            r.step()
            r.zero_grad()
    for p, q in zip([a[0].bias, *a[2].parameters()], [b[0].bias, *b[2].parameters()]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a[0].weight, _model()[0].weight, rtol=0, atol=0)
    assert a[0].weight not in opt.state and float(opt.state[a[0].bias]["step"]) == 3


def test_apex_optimizer_and_ddp_classes_support_isinstance_and_subclassing() -> None:
    """Megatron's ``assert isinstance(optimizer, FusedAdam)``, fairseq's ``class FusedAdamV2(FusedAdam)`` and
    DeepLearningExamples' ``isinstance(model, DDP)`` with apex's DDP: apex's names were functions returning torch
    objects, so isinstance raised TypeError and subclassing failed."""
    from overdrive.apex.optimizers import FusedAdam, FusedSGD
    from overdrive.apex.optimizers.fused_adam import FusedAdam as FromSubmodule

    class FusedAdamV2(FusedAdam):
        pass

    opt = FusedAdamV2(_model().parameters(), lr=1e-3)
    assert isinstance(opt, FusedAdam) and FromSubmodule is FusedAdam
    from overdrive.apex.parallel import DistributedDataParallel as ApexDDP
    from overdrive.apex.parallel.distributed import DistributedDataParallel as FromDistributed

    assert issubclass(ApexDDP, nn.parallel.DistributedDataParallel) and FromDistributed is ApexDDP
    assert isinstance(FusedSGD(_model().parameters(), lr=0.1), (FusedSGD, torch.optim.SGD))


def _lamb_reference(params: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]], lr: float, wd: float,
                    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, max_norm: float = 1.0) -> list[torch.Tensor]:
    """apex's FusedLAMB (adam_w_mode, grad_averaging, bias correction), in float64, written out."""
    w = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        gs = [g.double() for g in grads]
        norm = torch.sqrt(sum((g * g).sum() for g in gs))
        gs = [g / (norm / max_norm) if norm > max_norm else g for g in gs]
        for i, g in enumerate(gs):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps) + wd * w[i]
            r = w[i].norm() / u.norm() if w[i].norm() > 0 and u.norm() > 0 else 1.0
            w[i] = w[i] - lr * r * u
    return w


def test_fused_lamb_matches_a_float64_reference() -> None:
    from overdrive.apex.optimizers import FusedLAMB

    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = FusedLAMB(model.parameters(), lr=1e-2, weight_decay=0.01)
    grads = []
    for i in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        (model(x).square().mean() * 10).backward()  # * 10: the global norm exceeds max_grad_norm, so it clips
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    # the reference replays the same gradients (taken at overdrive's weights, so the two follow one path)
    ref_model = [p.clone() for p in start]
    ref = _lamb_reference(ref_model, grads, lr=1e-2, wd=0.01)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.double(), r, rtol=1e-5, atol=1e-6)  # fp32 arithmetic against float64


def test_distributed_data_parallel_accepts_apex_kwargs(tmp_path) -> None:  # noqa: ANN001
    import torch.distributed as dist

    from overdrive.apex.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, ref = _model(), _model()
        ddp = DistributedDataParallel(model, delay_allreduce=True, message_size=250_000)
        assert isinstance(ddp, nn.parallel.DistributedDataParallel)
        assert ddp.bucket_bytes_cap == int(250_000 * 4 / 2**20 * 1024 * 1024)
        x = torch.randn(5, 8)
        ddp(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)  # one rank: the average is the gradient itself (tolerance 0)
        with pytest.raises(UsageError, match="gradient_average=False"):
            DistributedDataParallel(_model(), gradient_average=False)
        del ddp  # the reducer goes before its process group (gloo's teardown hung now and then after it)
    finally:
        gc.collect()
        dist.destroy_process_group()


def _apex_ddp_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist

    from overdrive.apex.parallel import DistributedDataParallel

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: the two ranks are this machine's
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4).to(torch.bfloat16)
        ddp = DistributedDataParallel(model, allreduce_always_fp32=True, delay_allreduce=True)
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank)).bfloat16()
        ddp.disable_allreduce()  # accumulation steps: no communication
        ddp(x).float().square().mean().backward()
        local = [q.grad.clone() for q in model.parameters()]
        ddp.enable_allreduce()
        model.zero_grad()
        ddp(x).float().square().mean().backward()
        torch.save({"local": local, "reduced": [q.grad.clone() for q in model.parameters()]}, f"{out}/{rank}.pt")
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # gloo's teardown hangs now and then on this machine (one run in three here, with the results written):
    # both ranks are past their last collective, so leave without it
    os._exit(0)


def test_apex_ddp_fp32_allreduce_and_disable_allreduce_on_two_ranks(tmp_path) -> None:  # noqa: ANN001
    """``DDP(model, allreduce_always_fp32=True)`` was refused, and ``model.disable_allreduce()`` (DeepLearningExamples'
    fairseq trainer, during accumulation) raised AttributeError. Two gloo ranks, bf16 parameters: with allreduce
    disabled each rank keeps its own gradient; enabled, both hold the fp32 average of the two rounded once to bf16
    (tolerance 0: halving and adding two bf16 values is exact in fp32)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_apex_ddp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    assert not torch.equal(r0["local"][0], r1["local"][0])
    for a, b, g0, g1 in zip(r0["local"], r1["local"], r0["reduced"], r1["reduced"]):
        want = (a.float() / 2 + b.float() / 2).to(torch.bfloat16)
        assert g0.dtype == torch.bfloat16 and torch.equal(g0, want) and torch.equal(g1, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_layer_norm_matches_a_float64_reference(dtype: torch.dtype) -> None:
    """``from apex.normalization import FusedLayerNorm, FusedRMSNorm`` (and the Mixed forms) ported by the import:
    outputs in the input's dtype (the Mixed forms: the parameters' dtype, as apex's mixed-dtype kernels), equal to
    layer / RMS norm computed in float64 from the same (random affine) parameters within the dtype's rounding;
    fp32 parameters with half inputs (O2's norms, the Mixed classes) work."""
    from overdrive.apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 3 + 1
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    for cls in (FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm, MixedFusedRMSNorm):
        norm = cls(16, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(16, generator=g) + 0.5)
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.randn(16, generator=g))
        w = norm.weight.double()
        if "LayerNorm" in cls.__name__:
            want = (x64 - x64.mean(-1, keepdim=True)) / (x64.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
            want = want * w + norm.bias.double()
        else:
            want = x64 / (x64.square().mean(-1, keepdim=True) + 1e-5).sqrt() * w
        got = norm(x64.to(dtype))  # fp32 parameters, input in dtype
        assert got.dtype == (torch.float32 if cls.__name__.startswith("Mixed") else dtype)
        assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item(), cls.__name__
        if not cls.__name__.startswith("Mixed"):  # the same dtype throughout (O2 with the norm cast too)
            same = norm.to(dtype)(x64.to(dtype))
            assert (same.double() - want).abs().max().item() <= 2 * tol * want.abs().max().item(), cls.__name__
    assert set(FusedLayerNorm(16).state_dict()) == {"weight", "bias"}  # apex checkpoints' names
    assert set(FusedRMSNorm(16).state_dict()) == {"weight"}


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad"])
def test_param_groups_given_generators_keep_their_parameters(name: str) -> None:
    """``[{"params": model.body.parameters()}, {"params": model.head.parameters(), "lr": ...}]``: FusedAdam, FusedSGD
    and FusedAdagrad read each group's generator to pick fused kernels, and torch then got empty groups, so those
    layers never trained, silently."""
    import overdrive.apex.optimizers as optimizers

    model = _model()
    opt = getattr(optimizers, name)([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}],
                                    lr=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    before = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, n=1)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_fused_layer_norm_submodule_and_functions() -> None:
    """``from apex.normalization.fused_layer_norm import FusedLayerNorm`` (pytorch-pretrained-BERT, transformers 2)
    and Megatron's ``FusedLayerNormAffineFunction.apply(x, w, b, shape, eps)`` raised ModuleNotFoundError.
    Reference: torch's layer/RMS norm in fp32; bf16 inputs within bf16 rounding of it, gradients flowing."""
    from overdrive.apex.normalization import FusedLayerNorm as Top
    from overdrive.apex.normalization.fused_layer_norm import (
        FusedLayerNorm,
        FusedLayerNormAffineFunction,
        FusedRMSNormAffineFunction,
        fused_layer_norm,
        fused_rms_norm_affine,
    )

    assert FusedLayerNorm is Top
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g) * 3 + 1
    w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    ref = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    torch.testing.assert_close(FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-5), ref)
    half = FusedLayerNormAffineFunction.apply(x.bfloat16(), w, b, 8, 1e-5)  # Megatron: bf16 activations, fp32 params
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(fused_layer_norm(x, [8]), torch.nn.functional.layer_norm(x, (8,), eps=1e-6))
    rms = fused_rms_norm_affine(x, w, (8,), 1e-6)
    torch.testing.assert_close(rms, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)
    xg = x.clone().requires_grad_(True)
    FusedRMSNormAffineFunction.apply(xg, w, (8,), 1e-6).sum().backward()
    assert xg.grad is not None and bool(torch.isfinite(xg.grad).all())
