"""ModelOpt's ``modelopt.torch.quantization.nn``: the quantizer and quantized layer classes, which are
overdrive.quant's own (``from overdrive.quant.modelopt.nn import TensorQuantizer`` in place of
``from modelopt.torch.quantization.nn import TensorQuantizer``), so ``isinstance(module, TensorQuantizer)`` loops
over a model that ``mtq.quantize`` quantized find every quantizer.

Example:
    >>> import torch
    >>> import overdrive.quant.modelopt as mtq
    >>> from overdrive.quant.modelopt.nn import TensorQuantizer
    >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG)
    >>> sorted(n for n, q in m.named_modules() if isinstance(q, TensorQuantizer))
    ['0.input_quantizer', '0.weight_quantizer']
"""

from overdrive.quant.modules import QuantConv1d, QuantConv2d, QuantConv3d, QuantConvTranspose2d, QuantLinear
from overdrive.quant.quantizer import TensorQuantizer

__all__ = ["TensorQuantizer", "QuantLinear", "QuantConv1d", "QuantConv2d", "QuantConv3d", "QuantConvTranspose2d"]
