"""overdrive.quant: PTQ and QAT with calibrators, ONNX Q/DQ export, real int8/fp8 modules.

Example:
    >>> import torch
    >>> from overdrive import quant
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> model = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(32, 8)))
    >>> model(torch.randn(2, 8)).shape
    torch.Size([2, 4])
"""

from overdrive.quant._deprecated import qat
from overdrive.quant.api import (
    CALIBRATORS,
    calibrate,
    compare_calibrators,
    load_calib_amax,
    partial_quantize,
    print_summary,
    quantize,
    quantized_layers,
    quantizers,
    sensitivity,
    set_quantizers_enabled,
    summary,
)
from overdrive.quant.config import (
    FP8_DEFAULT,
    INT8_ATTENTION,
    INT8_DEFAULT,
    INT8_SMOOTHQUANT,
    INT8_DYNAMIC,
    INT8_DYNAMIC_SMOOTHQUANT,
    PRESETS,
    QuantConfig,
    QuantizerConfig,
    RealConfig,
    WeightOnlyConfig,
    get_preset,
)
from overdrive.quant.export import export_onnx
from overdrive.quant.modules import (
    QuantAdd,
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose2d,
    QuantLinear,
    QuantMatmul,
    QuantSDPA,
)
from overdrive.quant.quantizer import TensorQuantizer
from overdrive.quant.real import Fp8Linear, Int8Linear, QuantizedResidualAdd, dynamic_int8, to_real
from overdrive.quant.weight_only import WeightOnlyLinear, weight_only
from overdrive.quant.api import smoothed_float
from overdrive.quant.smoothquant import SmoothedLinear
from overdrive.quant.tied import TiedEmbedding

__all__ = [
    # configs
    "QuantConfig", "QuantizerConfig", "INT8_DEFAULT", "FP8_DEFAULT", "INT8_ATTENTION", "INT8_SMOOTHQUANT", "INT8_DYNAMIC", "INT8_DYNAMIC_SMOOTHQUANT", "PRESETS", "get_preset",
    "RealConfig", "WeightOnlyConfig",
    # PTQ / QAT
    "quantize", "calibrate", "load_calib_amax", "print_summary", "summary", "quantizers", "quantized_layers",
    "set_quantizers_enabled", "compare_calibrators", "CALIBRATORS", "sensitivity", "partial_quantize", "qat",
    # modules
    "TensorQuantizer", "QuantLinear", "QuantConv1d", "QuantConv2d", "QuantConv3d", "QuantConvTranspose2d", "QuantAdd",
    "QuantMatmul", "QuantSDPA",
    # export and real low precision
    "export_onnx", "to_real", "Int8Linear", "Fp8Linear", "QuantizedResidualAdd", "weight_only", "WeightOnlyLinear", "dynamic_int8",
    "SmoothedLinear", "smoothed_float", "TiedEmbedding",
]
