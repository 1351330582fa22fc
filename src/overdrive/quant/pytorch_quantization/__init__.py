"""pytorch-quantization's names over overdrive.quant, so a script written for NVIDIA's pytorch-quantization
(the TensorRT samples) runs with one line changed:
``from pytorch_quantization import quant_modules, nn as quant_nn, calib, tensor_quant`` ->
``from overdrive.quant.pytorch_quantization import quant_modules, nn as quant_nn, calib, tensor_quant``.

Every module and quantizer here is an overdrive.quant one (``quant_nn.QuantLinear`` subclasses
``quant.QuantLinear``, ``quant_nn.TensorQuantizer`` is ``quant.TensorQuantizer`` plus a QuantDescriptor
constructor), so the native verbs (``quant.calibrate``, ``quant.print_summary``, ``quant.export_onnx``,
``quant.to_real``) work on the models these scripts build.

Example:
    >>> import torch
    >>> from overdrive.quant.pytorch_quantization import nn as quant_nn
    >>> from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor
    >>> fc = quant_nn.QuantLinear(8, 4, quant_desc_input=QuantDescriptor(calib_method="histogram"))
    >>> for q in (fc._input_quantizer, fc._weight_quantizer): q.disable_quant(); q.enable_calib()
    >>> _ = fc(torch.randn(16, 8))
    >>> fc._input_quantizer.load_calib_amax(method="percentile", percentile=99.99); fc._weight_quantizer.load_calib_amax()
    >>> for q in (fc._input_quantizer, fc._weight_quantizer): q.enable_quant(); q.disable_calib()
    >>> fc(torch.randn(2, 8)).shape, fc._weight_quantizer.amax.shape
    (torch.Size([2, 4]), torch.Size([4]))
"""

from overdrive.quant.pytorch_quantization import calib, nn, quant_modules, tensor_quant, utils
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

__all__ = ["quant_modules", "nn", "calib", "tensor_quant", "utils", "QuantDescriptor"]
