"""QAT gradients of the fake quantizers against hand-written references (exact comparison, small tensors).

Reference: pytorch-quantization's clipped straight-through estimator: the gradient passes where |x| <= amax
and is zero outside; amax gets none (fixed in QAT). The same rule holds for fp8 e4m3 (scale = amax / 448).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive.quant.config import QuantizerConfig
from overdrive.quant.quantizer import TensorQuantizer


def _reference(x: torch.Tensor, amax: torch.Tensor, fmt: str, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake-quantized ``x`` and its clipped-STE gradient mask, written out (per channel along ``axis``)."""
    a = amax if axis is None else amax.view([-1 if d == axis % x.dim() else 1 for d in range(x.dim())])
    if fmt == "int8":
        s = a / 127
        y = torch.clamp(torch.round(x / s), -128, 127) * s
    else:
        s = a / 448
        y = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return y, (x.abs() <= a).float()


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_gradient_at_and_next_to_amax_is_the_clipped_ste(fmt: str) -> None:
    # x == amax exactly (a max-calibrated weight's largest value) must keep its gradient, the next float above
    # must not: fp8 compared |x / scale| with 448 and dropped it in about 1 channel in 10
    torch.manual_seed(0)
    amax = torch.rand(200) * 10 + 1e-3
    q = TensorQuantizer(QuantizerConfig(format=fmt, per_channel=True), axis=0)
    q.amax = amax
    below = torch.nextafter(amax, torch.zeros(()))
    above = torch.nextafter(amax, torch.full((), 1e3))
    x = torch.stack([amax, -amax, below, above, -above], 1).requires_grad_()  # (C, 5)
    y = q(x)
    y.backward(torch.ones_like(y))
    ref_y, ref_g = _reference(x.detach(), amax, fmt, 0)
    assert torch.equal(y, ref_y)
    assert torch.equal(x.grad, ref_g), f"{int((x.grad != ref_g).sum())} gradients differ from |x| <= amax"
    assert q.amax.grad is None


def test_fp8_max_calibrated_weight_gets_every_gradient() -> None:
    # every weight lies within its channel's max-calibrated amax, so the weight gradient equals the gradient
    # taken with respect to the fake-quantized weight (nothing is clipped)
    torch.manual_seed(0)
    layer = quant.quantize(nn.Linear(16, 64), quant.FP8_DEFAULT, forward_loop=lambda m: m(torch.randn(8, 16)))
    x = torch.randn(8, 16)
    layer(x).square().sum().backward()
    wq = layer.weight_quantizer(layer.weight.detach()).requires_grad_()
    torch.nn.functional.linear(layer.input_quantizer(x), wq, layer.bias.detach()).square().sum().backward()
    assert torch.equal(layer.weight.grad, wq.grad)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_negative_per_channel_axis(fmt: str) -> None:
    # TensorQuantizer(axis=-1): one amax per last-dimension channel; int8 raised torch's
    # "`axis` must be between 0 and number of dimensions of input"
    torch.manual_seed(0)
    amax = torch.tensor([1.0, 2.0, 4.0])
    q = TensorQuantizer(QuantizerConfig(format=fmt, per_channel=True), axis=-1)
    q.amax = amax
    x = (torch.randn(2, 5, 3) * 3).requires_grad_()
    y = q(x)
    y.backward(torch.ones_like(y))
    ref_y, ref_g = _reference(x.detach(), amax, fmt, -1)
    assert torch.allclose(y, ref_y, rtol=0, atol=1e-6)
    assert torch.equal(x.grad, ref_g)
