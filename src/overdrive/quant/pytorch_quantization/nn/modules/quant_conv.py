"""``pytorch_quantization.nn.modules.quant_conv``: the quantized convolutions (also as ``Conv2d`` etc.).

Example:
    >>> from overdrive.quant.pytorch_quantization.nn.modules.quant_conv import QuantConvTranspose1d
    >>> QuantConvTranspose1d(4, 2, 3).weight_quantizer.axis
    (1,)
"""

from overdrive.quant.pytorch_quantization.nn import (
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
)

Conv1d, Conv2d, Conv3d = QuantConv1d, QuantConv2d, QuantConv3d
ConvTranspose1d, ConvTranspose2d, ConvTranspose3d = QuantConvTranspose1d, QuantConvTranspose2d, QuantConvTranspose3d

__all__ = ["QuantConv1d", "QuantConv2d", "QuantConv3d", "QuantConvTranspose1d", "QuantConvTranspose2d",
           "QuantConvTranspose3d", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]
