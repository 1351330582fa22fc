"""``overdrive.apex``: apex's import paths, one changed line each (issue 20), with the numbers checked
against torch's own optimizers and DDP, and a float64 LAMB written out here."""

from __future__ import annotations

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
    assert type(opt) is (torch.optim.AdamW if adam_w_mode else torch.optim.Adam) and opt.defaults["fused"]
    ref = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(b.parameters(), lr=1e-2, weight_decay=0.1,
                                                                  foreach=False)
    _steps(a, opt)
    _steps(b, ref)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # fused vs the for-loop kernel: fp32 rounding
    with pytest.raises(UsageError, match="bias_correction=False"):
        FusedAdam(a.parameters(), bias_correction=False)


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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_layer_norm_matches_a_float64_reference(dtype: torch.dtype) -> None:
    """``from apex.normalization import FusedLayerNorm, FusedRMSNorm`` (and the Mixed forms) ported by the import:
    outputs in the input's dtype, equal to layer / RMS norm computed in float64 from the same (random affine)
    parameters within the dtype's rounding; fp32 parameters with half inputs (O2's norms, the Mixed classes) work."""
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
        assert got.dtype == dtype
        assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item(), cls.__name__
        if not cls.__name__.startswith("Mixed"):  # the same dtype throughout (O2 with the norm cast too)
            same = norm.to(dtype)(x64.to(dtype))
            assert (same.double() - want).abs().max().item() <= 2 * tol * want.abs().max().item(), cls.__name__
    assert set(FusedLayerNorm(16).state_dict()) == {"weight", "bias"}  # apex checkpoints' names
    assert set(FusedRMSNorm(16).state_dict()) == {"weight"}
