"""pytorch-quantization's names as scripts use them: the quantized layers without their Quant prefix
(``quant_nn.Conv2d``), and TensorQuantizer's ``_if_quant`` / ``_if_calib`` flags."""

from __future__ import annotations

import pytest
import torch

from overdrive.quant.pytorch_quantization import calib, tensor_quant
from overdrive.quant.pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor


def test_unprefixed_layer_aliases_are_the_quant_layers():
    """pytorch-quantization's docs build layers as ``quant_nn.Conv2d(...)`` / ``quant_nn.Linear(...)`` /
    ``quant_nn.MaxPool2d(...)``: its ``nn`` exports every quantized layer also without the Quant prefix."""
    torch.manual_seed(0)
    desc_in = QuantDescriptor(num_bits=8, calib_method="histogram")
    conv = quant_nn.Conv2d(3, 4, 3, quant_desc_input=desc_in,
                           quant_desc_weight=tensor_quant.QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL)
    fc = quant_nn.Linear(4, 2, quant_desc_input=tensor_quant.QUANT_DESC_8BIT_PER_TENSOR)
    pool = quant_nn.MaxPool2d(kernel_size=2, stride=2, quant_desc_input=desc_in)
    assert type(conv) is quant_nn.QuantConv2d and type(fc) is quant_nn.QuantLinear
    assert type(pool) is quant_nn.QuantMaxPool2d and isinstance(conv._input_quantizer._calibrator, calib.HistogramCalibrator)
    for alias in ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
                  "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
                  "AdaptiveAvgPool2d", "AdaptiveAvgPool3d"):
        assert getattr(quant_nn, alias) is getattr(quant_nn, f"Quant{alias}") and alias in quant_nn.__all__
    from overdrive.quant.pytorch_quantization.nn.modules import quant_pooling
    assert quant_pooling.AdaptiveAvgPool2d is quant_nn.QuantAdaptiveAvgPool2d
    with pytest.raises(AttributeError, match="recurrent layers are not quantized"):
        quant_nn.LSTM  # noqa: B018  (pytorch-quantization's alias of QuantLSTM: say why, not "no attribute")


def test_if_quant_and_if_calib_flags_read_and_set_the_modes():
    """pytorch-quantization's (and ModelOpt's) ``_if_quant`` / ``_if_calib``, which scripts read to find the
    quantizers still calibrating and set directly instead of calling enable_calib() / disable_quant()."""
    torch.manual_seed(0)
    q = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    assert q._if_quant is True and q._if_calib is False
    x = torch.randn(1000)
    q._if_quant, q._if_calib = False, True  # as disable_quant(); enable_calib()
    assert not q.quant_enabled and q.calibrating
    assert torch.equal(q(x), x)  # observing: values pass through
    q._if_calib, q._if_quant = False, True
    q.load_calib_amax("percentile", percentile=99.99)
    ref = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    ref.disable_quant(); ref.enable_calib(); ref(x); ref.disable_calib(); ref.enable_quant()
    ref.load_calib_amax("percentile", percentile=99.99)
    assert q._if_quant and not q._if_calib and torch.equal(q.amax, ref.amax) and torch.equal(q(x), ref(x))
