"""``pytorch_quantization.nn.modules.quant_linear``: ``QuantLinear`` (also as ``Linear``).

Example:
    >>> from overdrive.quant.pytorch_quantization.nn.modules.quant_linear import QuantLinear
    >>> QuantLinear(4, 2).weight_quantizer.axis
    (0,)
"""

from overdrive.quant.pytorch_quantization.nn import QuantLinear

Linear = QuantLinear

__all__ = ["QuantLinear", "Linear"]
