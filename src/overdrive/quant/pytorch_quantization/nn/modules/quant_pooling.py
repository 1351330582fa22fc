"""``pytorch_quantization.nn.modules.quant_pooling``: the pooling layers with a quantized input (also as
``MaxPool2d`` etc.).

Example:
    >>> from overdrive.quant.pytorch_quantization.nn.modules.quant_pooling import QuantMaxPool2d
    >>> QuantMaxPool2d(2).input_quantizer.axis is None
    True
"""

from overdrive.quant.pytorch_quantization.nn import (
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
    QuantAvgPool1d,
    QuantAvgPool2d,
    QuantAvgPool3d,
    QuantMaxPool1d,
    QuantMaxPool2d,
    QuantMaxPool3d,
)

MaxPool1d, MaxPool2d, MaxPool3d = QuantMaxPool1d, QuantMaxPool2d, QuantMaxPool3d
AvgPool1d, AvgPool2d, AvgPool3d = QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d
AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = QuantAdaptiveAvgPool1d, QuantAdaptiveAvgPool2d, QuantAdaptiveAvgPool3d

__all__ = ["QuantMaxPool1d", "QuantMaxPool2d", "QuantMaxPool3d", "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d",
           "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d", "QuantAdaptiveAvgPool3d", "MaxPool1d", "MaxPool2d",
           "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
           "AdaptiveAvgPool3d"]
