"""Weight-only int8 / int4 for memory-bound Linear layers (``quant.weight_only``): weights stored in 8 or 4 bits with
group-wise scales, dequantized to the activations' dtype inside each call; activations stay in float.

Example:
    >>> import torch
    >>> m = weight_only(torch.nn.Sequential(torch.nn.Linear(256, 256)), bits=8)
    >>> type(m[0]).__name__
    'WeightOnlyLinear'
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant.config import WeightOnlyConfig
from overdrive.quant.modules import hf_conv1d_class
from overdrive.quant._swap import _config, _set
from overdrive.quant.tied import read_only_weight_error, retie, tied_embeddings


class WeightOnlyLinear(nn.Module):
    """Linear with int8 or int4 weights and group-wise fp scales; dequantizes per call (memory-bound
    layers: the weight read shrinks 2x / 4x vs bf16).

    Example:
        >>> lin = torch.nn.Linear(256, 64)
        >>> q = WeightOnlyLinear.from_linear(lin, bits=4, group_size=128)
        >>> bool((q(torch.randn(2, 256)) - lin(torch.randn(2, 256))).abs().max() < 10)
        True
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int,
                 in_features: int) -> None:
        super().__init__()
        self.register_buffer("q", q)  # int8 (N, K) or uint8 (N, K/2) two int4 per byte
        self.register_buffer("scales", scales)  # (N, K / group_size)
        self.register_buffer("bias", bias)
        self.bits, self.group_size, self.in_features = bits, group_size, in_features
        self.out_features = q.shape[0]

    @classmethod
    def from_linear(cls, lin: nn.Module, bits: int = 8, group_size: int = 128) -> WeightOnlyLinear:
        """From an ``nn.Linear``, or a Hugging Face GPT-2 ``Conv1D`` (its weight is (in, out), used transposed)."""
        if bits not in (4, 8):
            raise UsageError(f"weight-only bits={bits} must be 4 or 8")
        weight = lin.weight.t() if _is_hf_conv1d(lin) else lin.weight  # (N, K)
        n, k = weight.shape
        if group_size <= 0 or k % group_size:
            raise UsageError(f"group_size={group_size} must divide in_features={k} (e.g. 32, 64, 128)")
        if bits == 4 and k % 2:
            raise UsageError(f"int4 packs two weights per byte, so in_features={k} must be even; use bits=8 for "
                             "this layer (or exclude it)")
        w = weight.detach().float().reshape(n, k // group_size, group_size)
        qmax = 127 if bits == 8 else 7
        scales = w.abs().amax(-1).clamp_min(1e-12) / qmax  # (N, G)
        q = torch.clamp(torch.round(w / scales.unsqueeze(-1)), -qmax - (bits == 4), qmax).view(n, k)
        if bits == 8:
            q = q.to(torch.int8)
        else:
            u = (q + 8).to(torch.uint8)  # [-8, 7] -> [0, 15]
            q = u[:, 0::2] | (u[:, 1::2] << 4)
        bias = None if lin.bias is None else lin.bias.detach().clone()
        return cls(q, scales.to(weight.dtype), bias, bits, group_size, k)

    @classmethod
    def from_quantized(cls, layer: nn.Module) -> WeightOnlyLinear:
        """The int8 weights a calibrated fake-quant layer computes, stored: a ``QuantLinear`` / GPT-2 ``QuantConv1D``
        whose input quantizer is off and whose weight quantizer is int8 per output channel or per tensor
        (``mtq.INT8_WEIGHT_ONLY_CFG``). One group spans the row, its scale is amax / 127 and the codes are
        ``clamp(round(w / scale), qmin, 127)``, the fake quantization's, so the outputs are the fake-quant model's.

        Example:
            >>> from overdrive import quant
            >>> cfg = quant.QuantConfig(input=quant.QuantizerConfig(enabled=False))
            >>> m = quant.quantize(torch.nn.Sequential(torch.nn.Linear(16, 8)), cfg)
            >>> q = WeightOnlyLinear.from_quantized(m[0])
            >>> x = torch.randn(2, 16); bool((q(x) - m(x)).abs().max() < 1e-6)
            True
        """
        wq = layer.weight_quantizer
        weight = layer.weight.detach()
        conv1d = hf_conv1d_class()  # GPT-2's QuantConv1D subclasses it; its weight is (in, out)
        w = (weight.t() if conv1d is not None and isinstance(layer, conv1d) else weight).float()  # (N, K)
        n, k = w.shape
        scale = wq.scale().reshape(-1, 1).expand(n, 1).to(w.device)  # (N, 1): per channel, or one per tensor
        qmin = -127 if wq.config.narrow_range else -128
        # x * (1 / scale), round half to even, clamp: torch.fake_quantize's arithmetic, code for code
        q = torch.clamp(torch.round(w * (1.0 / scale)), qmin, 127).to(torch.int8)
        bias = None if layer.bias is None else layer.bias.detach().clone()
        return cls(q, scale.to(weight.dtype).contiguous(), bias, 8, k, k)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.bits == 8:
            q = self.q.to(dtype)
        else:
            q = torch.stack([(self.q & 0xF), (self.q >> 4)], dim=-1).view(self.out_features, -1).to(dtype) - 8
        n, k = self.out_features, self.in_features
        return (q.view(n, k // self.group_size, self.group_size) * self.scales.to(dtype).unsqueeze(-1)).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of :attr:`weight`, dequantized alone (``(*ids.shape, K)``): the lookup of an input embedding
        tied to this layer (:class:`~overdrive.quant.tied.TiedEmbedding`), equal to ``weight[ids]``.

        Example:
            >>> q = WeightOnlyLinear.from_linear(torch.nn.Linear(64, 16), bits=4, group_size=32)
            >>> torch.equal(q.rows(torch.tensor([2, 7])), q.weight[[2, 7]])
            True
        """
        dtype = self.scales.dtype
        q = self.q[ids]  # (*, K) int8, or (*, K/2) uint8 for int4
        if self.bits == 8:
            q = q.to(dtype)
        else:
            q = torch.stack([(q & 0xF), (q >> 4)], dim=-1).flatten(-2).to(dtype) - 8
        g = self.in_features // self.group_size
        return (q.unflatten(-1, (g, self.group_size)) * self.scales[ids].to(dtype).unsqueeze(-1)).flatten(-2)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (N, K) weight in the scales' dtype, computed on each read (model code such as Hugging Face
        T5's reads ``layer.weight.dtype``)."""
        return self.dequantized_weight(self.scales.dtype)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":
            raise read_only_weight_error(self, f"int{self.bits} weights")
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, int{self.bits}, group_size={self.group_size}"


def _is_hf_conv1d(m: nn.Module) -> bool:
    conv1d = hf_conv1d_class()
    return conv1d is not None and type(m) is conv1d


def weight_only(model: nn.Module, config: WeightOnlyConfig | None = None, **settings: Any) -> nn.Module:
    """Swap float nn.Linear layers and Hugging Face GPT-2 ``Conv1D`` layers (both dims >= ``min_features``,
    in_features divisible by ``group_size``, name not matching ``exclude``) for :class:`WeightOnlyLinear`.
    A model with no such layer is a UsageError saying why each candidate was left.

    The settings are a :class:`WeightOnlyConfig`, given as ``config``, as keywords that replace its fields
    (``weight_only(model, bits=4, group_size=64)``), or both.

    Example:
        >>> m = weight_only(nn.Sequential(nn.Linear(256, 256)), WeightOnlyConfig(bits=4))
        >>> type(m[0]).__name__, m[0].bits
        ('WeightOnlyLinear', 4)
    """
    import fnmatch

    if isinstance(config, int) and not isinstance(config, bool):  # the old second positional argument: bits
        settings = {"bits": config, **settings}
        config = None
    cfg = _config(WeightOnlyConfig, config, settings)
    if isinstance(model, nn.Linear) or _is_hf_conv1d(model):
        return WeightOnlyLinear.from_linear(model, cfg.bits, cfg.group_size)
    left: dict[str, str] = {}  # why each candidate stayed float, for the error when none is converted
    converted = 0
    ties = tied_embeddings(model)  # embeddings sharing a head's weight read it from the converted head instead
    for name, m in list(model.named_modules()):
        if not (type(m) is nn.Linear or _is_hf_conv1d(m)):
            continue
        k, n = (m.weight.shape[0], m.weight.shape[1]) if _is_hf_conv1d(m) else (m.in_features, m.out_features)
        if min(k, n) < cfg.min_features:
            left[name] = f"{k}x{n} < min_features={cfg.min_features}"
        elif k % cfg.group_size:
            left[name] = f"in_features={k} not divisible by group_size={cfg.group_size}"
        elif cfg.bits == 4 and k % 2:
            left[name] = f"in_features={k} is odd (int4 packs two weights per byte)"
        elif any(fnmatch.fnmatch(name, p) for p in cfg.exclude):
            left[name] = "excluded"
        else:
            new = WeightOnlyLinear.from_linear(m, cfg.bits, cfg.group_size)
            _set(model, name, new)
            if type(m) is nn.Linear:
                retie(model, ties, m, new)
            converted += 1
    if not converted:
        why = "; ".join(f"{n}: {r}" for n, r in list(left.items())[:4]) + (" ..." if len(left) > 4 else "")
        raise UsageError(f"weight_only converted no layer: {len(left)} nn.Linear / Conv1D layer(s) ({why or 'none'}); "
                         "lower min_features, pick a group_size dividing in_features, or change exclude")
    return model
