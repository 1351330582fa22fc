"""SmoothQuant: move activation outliers into the weights, one factor per input channel.

A Linear ``y = x W^T`` equals ``(x / s) (W * s)^T`` for any positive per-input-channel ``s``. Transformer
activations carry a few channels tens of times larger than the rest (LayerNorm outputs), so one per-tensor int8
scale spends its range on them; weights are even and quantized per output channel. With

    s_j = max|x_j| ** alpha / max|W[:, j]| ** (1 - alpha)

both ``x / s`` and ``W * s`` have their channel maxima equalized (alpha 0.5: sqrt(max|x_j| * max|W_j|) for both),
and int8 loses less on the product. The factors live on the quantizers (``input_quantizer.pre_quant_scale`` =
1 / s, ``weight_quantizer.pre_quant_scale`` = s, as ModelOpt keeps them), so the float parameters are not
touched, a disabled quantizer pair still computes the float layer, and the ONNX graph has one Mul before each
input QuantizeLinear (and a constant-folded one on the weight).

Example:
    >>> import torch
    >>> from overdrive import quant
    >>> x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)); x[:, 3] *= 50   # one outlier channel
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    >>> q = quant.quantize(model, quant.INT8_SMOOTHQUANT, forward_loop=lambda m: m(x))
    >>> q[0].input_quantizer.pre_quant_scale.shape
    torch.Size([16])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from overdrive.quant.config import check_alpha
from overdrive.quant.modules import _QuantMixin, eval_mode
from overdrive.quant.quantizer import TensorQuantizer

_FLOOR = 1e-5  # a channel never seen nonzero, or an all-zero weight column, keeps factor 1 / the floor


def smoothable(m: nn.Module) -> bool:
    """True for quantized layers whose input's last dim is the weight's input axis (Linear, GPT-2's Conv1D)."""
    return isinstance(m, _QuantMixin) and m.weight.dim() == 2 and m.input_quantizer.enabled and \
        m.weight_quantizer.enabled


@torch.no_grad()
def smooth(model: nn.Module, forward_loop: Callable[[nn.Module], Any], alpha: float = 0.5) -> list[str]:
    """Run ``forward_loop(model)`` once in float (every quantizer passed through) recording each smoothable
    layer's per-input-channel max |x|, then set the factors on its two quantizers. Returns the layer names.

    Call before the weights' amax is computed (``quant.quantize`` does, when ``QuantConfig.smoothquant`` is set).
    """
    alpha = check_alpha(alpha)
    layers = {n: m for n, m in model.named_modules() if smoothable(m)}
    if not layers:
        return []
    act_max: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(mod: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            cur = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()  # (C_in,)
            act_max[name] = cur if name not in act_max else torch.maximum(act_max[name], cur)
        return record

    qs = [m for m in model.modules() if isinstance(m, TensorQuantizer)]
    flags = [(q, q.enabled) for q in qs]
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        for q in qs:
            q.enabled = False  # the float model (earlier factors, if any, stay applied: they keep the float math)
        with eval_mode(model):
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
        for q, enabled in flags:
            q.enabled = enabled
    done = []
    for name, m in layers.items():
        if name not in act_max:
            continue  # forward never reached it: calibration says so next
        iq, wq = m.input_quantizer, m.weight_quantizer
        w = wq.apply_pre_quant_scale(m.weight.detach()).float()
        x_max = act_max[name]
        if iq.pre_quant_scale is not None:  # smoothed before: the hook saw x / s_old, the weight is w * s_old
            x_max = x_max / iq.pre_quant_scale.to(x_max.device)
            w = m.weight.detach().float()
        dims = [d for d in range(w.dim()) if d != m.in_axis]
        w_max = w.abs().amax(dim=dims).to(x_max.device)  # (C_in,)
        s = x_max.clamp_min(_FLOOR).pow(alpha) / w_max.clamp_min(_FLOOR).pow(1.0 - alpha)
        s = torch.where(x_max > 0, s, torch.ones_like(s)).clamp_min(_FLOOR)
        iq.pre_quant_scale = (1.0 / s).to(m.weight.device)
        wq.pre_quant_scale = s.to(m.weight.device)
        done.append(name)
    return done


class SmoothedLinear(nn.Module):
    """A float Linear with SmoothQuant's factors folded in: ``y = (x * inv_s) @ (W * s)^T + b``, the function of the
    Linear it replaces (up to fp32 rounding), with the outlier channels of its input moved into the weight. Plain
    float ops, so it exports to ONNX (a Mul before the MatMul) and ``quant.dynamic_int8`` turns it into an int8 GEMM
    whose quantize step applies ``inv_s``.

    Example:
        >>> lin = nn.Linear(4, 2)
        >>> s = torch.tensor([1.0, 2.0, 4.0, 8.0])
        >>> sm = SmoothedLinear(lin.weight.detach() * s, lin.bias, 1 / s)
        >>> x = torch.randn(3, 4)
        >>> bool(torch.allclose(sm(x), lin(x), atol=1e-6))
        True
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, inv_s: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)  # (N, K): W * s
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("inv_s", inv_s.detach().float().reshape(-1).clone())
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x * self.inv_s.to(x.dtype), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, smoothed"
