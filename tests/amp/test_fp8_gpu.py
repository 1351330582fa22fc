"""fp8 training on a GPU with fp8 tensor cores (compute capability 8.9+: H100, H200, L40S), real fp8 GEMMs under
torch.compile. Run with `pytest -m gpu tests/amp/test_fp8_gpu.py`; skipped without CUDA, on older GPUs and without
torchao (pip install -e '.[fp8]')."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive import amp
from overdrive.amp import Fp8, Policy, prepare
from overdrive.amp import fp8 as fp8_mod

pytestmark = pytest.mark.gpu

D, HIDDEN = 1024, 4096  # GEMMs big enough that fp8's kernels are the ones a real model meets
STEPS = 20


@pytest.fixture(autouse=True)
def _fp8_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{torch.cuda.get_device_name()} has no fp8 tensor cores (compute capability < 8.9)")
    if not fp8_mod.is_available():
        pytest.skip("needs torchao: pip install -e '.[fp8]' (or pip install --no-deps torchao-*.whl)")
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, 16)
        return self.head(self.norm(x + self.down(nn.functional.gelu(self.up(x)))))


def task(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable classification: the label is which of 16 fixed directions the input leans to most."""
    g = torch.Generator(device="cuda").manual_seed(step % 8)
    x = torch.randn(2048, D, device="cuda", generator=g)
    dirs = torch.randn(D, 16, device="cuda", generator=torch.Generator(device="cuda").manual_seed(99))
    return x, (x @ dirs).argmax(1)


def fit(fp8: Fp8 | str | None, compile: bool = True, dtype: torch.dtype = torch.bfloat16) -> tuple[list[float], MLP]:
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mp = prepare(model, opt, Policy(opt_level="O2", dtype=dtype, fp8=fp8), autocast_hooks=False)
    fwd = torch.compile(model) if compile else model
    losses = []
    for i in range(STEPS):
        x, y = task(i)
        loss = nn.functional.cross_entropy(fwd(x).float(), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("recipe", amp.FP8_RECIPES)
def test_compiled_fp8_training_tracks_bf16(recipe: str) -> None:
    ref, _ = fit(None)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*outside torch.compile.*")  # compiled: no warning
        losses, model = fit(Fp8(recipe=recipe, min_features=1024, min_weight=0))
    assert type(model.up).__name__ == "Float8Linear" and type(model.head) is nn.Linear
    assert all(map(lambda v: v == v and abs(v) < float("inf"), losses)), losses
    assert losses[-1] < 0.8 * losses[0], losses  # it learns
    # fp8's casts (about 4% relative error per GEMM) move the loss curve little: the last 5 steps' mean within 10%
    tail, ref_tail = sum(losses[-5:]) / 5, sum(ref[-5:]) / 5
    assert abs(tail - ref_tail) < 0.1 * ref_tail, (losses, ref)


def test_fp16_with_dynamic_loss_scaling_through_the_apex_surface() -> None:
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.float16,
                                fp8=Fp8(recipe="tensorwise", min_features=1024, min_weight=0))
    fwd = torch.compile(model)
    losses = []
    for i in range(10):
        x, y = task(i)
        loss = nn.functional.cross_entropy(fwd(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert amp.mixed_precision_of(opt).scaler.dynamic
    assert all(v == v for v in losses) and losses[-1] < losses[0], losses
    rows = {r[0]: r[3] for r in amp.summary(model).rows}
    assert rows == {"up": "fp8", "down": "fp8", "head": "float16"}


def test_eager_fp8_warns_once_that_it_needs_compile() -> None:
    with pytest.warns(UserWarning, match="outside torch.compile") as rec:
        losses, _ = fit(Fp8(min_features=1024, min_weight=0), compile=False)
    assert len([w for w in rec if "torch.compile" in str(w.message)]) == 1
    assert all(v == v for v in losses)
