"""torch.nn's Transformer encoder and recurrent layers under quant.quantize / mtq.quantize.

In eval mode without gradients (calibration, ``torch.no_grad()`` inference) ``nn.TransformerEncoderLayer`` runs a
fused kernel on ``linear1.weight`` / ``linear2.weight`` and never calls those layers; the quantized layers must be
called all the same (reference: the same quantized model with gradients on, where torch takes the
module-by-module path)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError


def _encoder_model(num_layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    return nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoder(layer, num_layers)).eval()


def test_encoder_layer_linears_calibrated_and_quantized_without_grad():
    model = _encoder_model()
    x = torch.randn(4, 10, 8)
    q = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))  # no_grad inside
    for i in range(2):
        assert q[1].layers[i].linear1.input_quantizer.is_calibrated
        assert q[1].layers[i].linear2.input_quantizer.is_calibrated
    with torch.enable_grad():
        layer_by_layer = q(x)  # gradients on: torch's module-by-module path, the quantizers run
    with torch.no_grad():
        no_grad = q(x)
    with torch.inference_mode():
        inference = q(x)
    torch.testing.assert_close(no_grad, layer_by_layer.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(inference, layer_by_layer.detach(), rtol=0, atol=1e-6)
    with torch.no_grad():  # and it is not the float model
        assert (no_grad - model(x)).abs().max() > 1e-4


def test_encoder_with_padding_mask_quantized_without_grad():
    # an nn.TransformerEncoder packs a padded batch into a nested tensor in eval mode without gradients
    model = _encoder_model()
    x = torch.randn(4, 10, 8)
    pad = torch.zeros(4, 10, dtype=torch.bool)
    pad[:, 7:] = True
    q = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT,
                       forward_loop=lambda m: m[1](m[0](x), src_key_padding_mask=pad))
    with torch.enable_grad():
        ref = q[1](q[0](x), src_key_padding_mask=pad).detach()
    with torch.no_grad():
        out = q[1](q[0](x), src_key_padding_mask=pad)
    torch.testing.assert_close(out[:, :7], ref[:, :7], rtol=0, atol=1e-6)


def test_encoder_through_modelopt_face_and_state_dict_reload():
    import overdrive.quant.modelopt as mtq

    model = _encoder_model(num_layers=1)
    x = torch.randn(4, 10, 8)
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    assert q[1].layers[0].linear1.input_quantizer.is_calibrated
    fresh = mtq.quantize(copy.deepcopy(model), mtq.INT8_DEFAULT_CFG, None)
    fresh.load_state_dict(q.state_dict())
    with torch.enable_grad():
        ref = q(x).detach()
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), ref, rtol=0, atol=1e-6)


def test_recurrent_layers_listed_as_left_in_float():
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.cell = nn.GRUCell(16, 16)
            self.fc = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.lstm(x)
            return self.fc(self.cell(h[:, -1]))

    x = torch.randn(2, 5, 8)
    q = quant.quantize(Tagger(), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    skipped = quant.summary(q)["skipped"]
    assert set(skipped) == {"lstm", "cell"}
    assert "LSTM" in skipped["lstm"] and "stays in float" in skipped["lstm"]
    assert "GRUCell" in skipped["cell"]
    with pytest.raises(UsageError, match="LSTM: recurrent"):
        quant.quantize(nn.LSTM(8, 8), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
