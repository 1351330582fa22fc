"""quant.to_real / dynamic_int8 / weight_only on layers shared under several names, dtype casts of bias-free int8
layers, and int4 weights whose input dim is odd.

Reference: the calibrated fake-quant model (quant.quantize's output) on the same inputs; the real int8 model must
match it to within one output quantization step (here far below: 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError


class _SharedBlocks(nn.Module):
    """ALBERT-style weight sharing: one Linear registered three times in a ModuleList, plus an alias attribute."""

    def __init__(self) -> None:
        super().__init__()
        blk = nn.Linear(16, 16)
        self.layers = nn.ModuleList([blk] * 3)
        self.alias = blk
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.alias(x))


def _calibrated_shared() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    return quant.quantize(_SharedBlocks(), quant.INT8_DEFAULT, forward_loop=lambda m: m(x)), x


def test_to_real_converts_every_name_of_a_shared_layer() -> None:
    q, x = _calibrated_shared()
    real = quant.to_real(copy.deepcopy(q))
    # every name of the shared layer points at the one real module (only layers.0 was converted before)
    assert all(type(layer) is quant.Int8Linear for layer in real.layers)
    assert real.layers[0] is real.layers[2] is real.alias
    assert not any(isinstance(m, quant.QuantLinear) for m in real.modules())
    with torch.no_grad():
        assert (real(x) - q(x)).abs().max().item() < 1e-5


def test_dynamic_int8_and_weight_only_convert_every_name_of_a_shared_layer() -> None:
    torch.manual_seed(0)
    dyn = quant.dynamic_int8(_SharedBlocks())
    assert all(type(layer) is quant.Int8Linear for layer in dyn.layers) and type(dyn.alias) is quant.Int8Linear
    wo = quant.weight_only(_SharedBlocks(), bits=8, group_size=16, min_features=0)
    assert all(type(layer) is quant.WeightOnlyLinear for layer in wo.layers) and wo.layers[1] is wo.alias


def test_to_real_twice_says_the_model_is_already_converted() -> None:
    q, _ = _calibrated_shared()
    real = quant.to_real(q)
    with pytest.raises(UsageError, match="already converted"):
        quant.to_real(real)


@pytest.mark.parametrize("cast, dtype", [(lambda m: m.half(), torch.float16), (lambda m: m.bfloat16(), torch.bfloat16),
                                         (lambda m: m.to(torch.bfloat16), torch.bfloat16)])
def test_cast_changes_the_weight_dtype_of_a_bias_free_int8_linear(cast, dtype) -> None:
    # model code reads layer.weight.dtype (T5 casts its hidden states to wo.weight.dtype; wo has no bias): after
    # .half() a bias-free layer still said float32, as the float layer would not
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    q = quant.quantize(nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False)),
                       quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    real = quant.to_real(copy.deepcopy(q))
    assert real[0].weight.dtype == torch.float32
    low = cast(copy.deepcopy(real))
    assert low[0].weight.dtype == dtype and low[2].weight.dtype == dtype
    assert low[0].w_q.dtype == torch.int8 and low[0].x_scale.dtype == torch.float32  # 8-bit weights, fp32 scales
    back = low.float()
    assert back[0].weight.dtype == torch.float32
    with torch.no_grad():
        assert (back(x) - q(x)).abs().max().item() < 1e-5  # the cast round trip loses nothing
        y = low(x.to(dtype))
    assert y.dtype == dtype


def test_int4_weight_only_with_odd_in_features_is_a_clear_error() -> None:
    # group_size 3 divides 9, but int4 packs two weights per byte: this was a RuntimeError about tensor sizes
    with pytest.raises(UsageError, match=r"in_features=9 must be even"):
        quant.WeightOnlyLinear.from_linear(nn.Linear(9, 4), bits=4, group_size=3)
    with pytest.raises(UsageError, match=r"in_features=9 is odd"):
        quant.weight_only(nn.Sequential(nn.Linear(9, 4)), bits=4, group_size=3, min_features=0)
    # int8 packs nothing: the same layer converts, and matches its dequantized weight exactly
    lin = nn.Linear(9, 4)
    w8 = quant.WeightOnlyLinear.from_linear(lin, bits=8, group_size=3)
    x = torch.randn(5, 9)
    assert torch.allclose(w8(x), nn.functional.linear(x, w8.weight, lin.bias), atol=1e-6)
