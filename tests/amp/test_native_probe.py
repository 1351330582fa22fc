"""The native API with optimizers and gradients off the common path: closure optimizers (LBFGS) and sparse
gradients (``nn.Embedding(sparse=True)``) under O2's half model and fp32 masters, against fp32 references."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive import amp


def _regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return model, x, x.sum(1, keepdim=True)


def _lbfgs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mp: amp.MixedPrecision | None,
           opt: torch.optim.Optimizer, seen: list[bool]) -> tuple[float, float]:
    def closure() -> torch.Tensor:
        if mp is not None:  # each evaluation sees the masters' current values, rounded to the half dtype
            seen.append(all(torch.equal(h, m.to(h.dtype)) for h, m in mp.master_pairs()))
        opt.zero_grad()
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(4):
        opt.step(closure)
    return first, closure().item()


def test_lbfgs_closure_trains_o2_model_like_fp32():
    """LBFGS calls its closure inside ``step`` between updates of the parameters it holds (O2's fp32 masters):
    each call must evaluate the half model at the masters' current values, and its gradients must reach them.
    They did not: LBFGS at O2 saw no gradient and left the loss where it was (7.98 before and after)."""
    ref_model, x, y = _regression()
    ref_opt = torch.optim.LBFGS(ref_model.parameters(), lr=0.5, max_iter=5)
    ref_first, ref_last = _lbfgs(ref_model, x, y, None, ref_opt, [])

    model, x, y = _regression()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16))
    seen: list[bool] = []
    first, last = _lbfgs(model, x, y, mp, opt, seen)

    assert len(seen) > 5 and all(seen)
    assert ref_last < 0.02 * ref_first
    # bf16's forward moves the optimum a little: within 2x of fp32's final loss, 25x below the start
    assert last < 0.04 * first
    assert last < 2 * ref_last + 1e-2
    # the masters stepped, and the half model holds them after the step
    assert all(torch.equal(h, m.to(torch.bfloat16)) for h, m in mp.master_pairs())
    assert all(m.dtype == torch.float32 for m in mp.master_params())


def test_closure_keyword_reaches_masters_too():
    """``optimizer.step(closure=...)`` (a keyword) is wrapped as the positional form is."""
    model, x, y = _regression()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16))
    w0 = model[0].weight.detach().clone()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        return loss

    opt.step(closure=closure)
    assert not torch.equal(model[0].weight, w0)
    assert torch.equal(model[0].weight, next(iter(mp.master_params())).to(torch.bfloat16))


def _embedding_bag() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 8, sparse=True), nn.Linear(8, 1))


@pytest.mark.parametrize("optimizer", ["SGD", "SparseAdam"])
@pytest.mark.parametrize("loss_scale", [None, 128.0, "dynamic"])
def test_o2_sparse_embedding_gradients(optimizer, loss_scale):
    """``nn.Embedding(sparse=True)`` under O2: its sparse half gradient goes to its fp32 master as a sparse fp32
    gradient (unscaled, checked, accumulated over micro-batches). It failed in backward with "copy_() between
    dense and sparse Tensors is not implemented". Reference: the same two micro-batches and step in fp32."""
    batches = [torch.tensor([[1, 2, 3], [3, 4, 5]]), torch.tensor([[5, 6, 7], [1, 9, 9]])]

    def run(level: str | None) -> nn.Module:
        model = _embedding_bag()
        if optimizer == "SGD":
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
        else:  # SparseAdam takes only sparse gradients: the Linear goes to a second optimizer
            opt = [torch.optim.SparseAdam(model[0].parameters(), lr=0.05),
                   torch.optim.Adam(model[1].parameters(), lr=0.05)]
        opts = opt if isinstance(opt, list) else [opt]
        mp = None if level is None else amp.prepare(
            model, opts, amp.Policy(opt_level=level, dtype=torch.bfloat16, loss_scale=loss_scale))
        for ids in batches:
            loss = model(ids).float().mean(1).square().mean()
            if mp is None:
                loss.backward()
            else:
                mp.backward(loss)
        if mp is None:
            for o in opts:
                o.step()
        else:
            assert mp.step() is True
            assert all(m.dtype == torch.float32 for m in mp.master_params())
        return model

    ref, got = run(None), run("O2")
    assert got[0].weight.dtype == torch.bfloat16
    w0 = _embedding_bag()[0].weight
    moved = (ref[0].weight - w0).abs().max()
    assert moved > 1e-2
    # bf16 forward and bf16 weights: within 2% of the update plus one bf16 rounding of the weights
    err = (got[0].weight.float() - ref[0].weight).abs().max()
    assert err <= 0.02 * moved + 2 ** -8 * ref[0].weight.abs().max()


def test_o2_sparse_inf_gradient_is_skipped():
    """An inf in a sparse gradient is found on its fp32 copy, and the step is skipped (the weights unchanged)."""
    model = _embedding_bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16))
    before = model[0].weight.detach().clone()
    loss = model(torch.tensor([[1, 2]])).float().sum() * float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mp.backward(loss)
        assert mp.step() is False
    assert mp.skipped_steps == 1
    assert torch.equal(model[0].weight, before)


class _Spectral(nn.Module):
    """A Fourier layer (FNO's): complex weights mix the low frequencies of each channel."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, 5, dtype=torch.cfloat) * 0.1)  # (in, out, modes)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 8 channels, 8 points)
        xf = torch.fft.rfft(x.float(), dim=-1)  # (B, 8, 5) complex
        y = torch.fft.irfft(torch.einsum("bix,iox->box", xf, self.w), n=8, dim=-1)  # (B, 8, 8)
        return self.lin(y.transpose(1, 2).to(self.lin.weight.dtype))


def _spectral_grads(level: str | None, loss_scale: float | str | None = None,
                    poison: bool = False) -> tuple[_Spectral, amp.MixedPrecision | None, torch.Tensor]:
    torch.manual_seed(0)
    model = _Spectral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = None if level is None else amp.prepare(
        model, opt, amp.Policy(opt_level=level, dtype=torch.bfloat16, loss_scale=loss_scale))
    x = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(1))
    if level is None:  # the hand-written O1 loop: autocast over the forward, no scaler (bf16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
    else:
        loss = model(x).float().square().mean()
    if poison:
        loss = loss * float("inf")
    w0 = model.w.detach().clone()
    if mp is None:
        loss.backward()
        grad = model.w.grad.clone()
        opt.step()
    else:
        mp.backward(loss)
        grad = model.w.grad.clone() if model.w.grad is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mp.step()
    model.w0 = w0  # type: ignore[attr-defined]
    return model, mp, grad


@pytest.mark.parametrize("level,loss_scale", [("O0", None), ("O1", None), ("O1", "dynamic"), ("O1", 128.0),
                                              ("O2", None), ("O3", None)])
def test_complex_parameters_train_at_every_level(level, loss_scale):
    """Complex parameters (spectral / Fourier layers) get their gradients checked for inf/NaN and unscaled like
    real ones. The fused check raised NotImplementedError for ComplexFloat at every level, O0 included. O1 equals
    the hand-written autocast loop bit for bit (a power-of-two scale unscales exactly); the complex weights stay
    complex64 at O2/O3 (there is no complex bf16)."""
    ref, _, ref_grad = _spectral_grads(None)
    model, mp, grad = _spectral_grads(level, loss_scale)
    assert mp is not None and mp.skipped_steps == 0
    assert model.w.dtype == torch.cfloat
    if level == "O1":
        assert torch.equal(grad, ref_grad)
        assert torch.equal(model.w, ref.w)
    else:  # O0 is fp32, O2/O3 run the Linear in bf16: the complex gradient within 1% of its largest element
        assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-2 * ref_grad.abs().max().item())
        assert not torch.equal(model.w, model.w0)


@pytest.mark.parametrize("loss_scale", [None, "dynamic"])
def test_complex_inf_gradient_is_skipped(loss_scale):
    model, mp, _ = _spectral_grads("O1", loss_scale, poison=True)
    assert mp is not None and mp.skipped_steps == 1
    assert torch.equal(model.w, model.w0)
