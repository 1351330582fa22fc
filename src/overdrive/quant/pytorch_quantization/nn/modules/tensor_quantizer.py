"""``pytorch_quantization.nn.modules.tensor_quantizer``: ``TensorQuantizer``.

Example:
    >>> from overdrive.quant.pytorch_quantization.nn.modules.tensor_quantizer import TensorQuantizer
    >>> TensorQuantizer().axis is None
    True
"""

from overdrive.quant.pytorch_quantization.nn import TensorQuantizer

__all__ = ["TensorQuantizer"]
