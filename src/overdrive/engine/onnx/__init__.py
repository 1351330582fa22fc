"""overdrive.engine.onnx: overdrive's ONNX importer (an ONNX graph as an ``nn.Module`` that Inductor compiles) and
the calibration of float ONNX models into Q/DQ ones, or their dynamic int8 quantization.

Imports point one way: ``values`` (host/device values, the operator types) <- the operator modules, none of which
imports another: ``ops`` (elementwise and math), ``shape`` (shape and tensor manipulation), ``layers`` (MatMul,
Gemm, Conv, pools, norms, Softmax), ``qdq`` (QuantizeLinear, DequantizeLinear), ``rnn`` (LSTM, GRU, RNN),
``select`` (TopK, ArgMax, ArgMin, Reduce*, Einsum, Gather/Scatter*, OneHot, DepthToSpace, Resize), ``vision``
(GridSample, RoiAlign), ``dynamic`` (Compress, Unique) <- ``integer`` (MatMulInteger, ConvInteger, QLinearConv,
QLinearMatMul, DynamicQuantizeLinear; it reuses ``layers``' Conv) <- ``qlinear`` (com.microsoft QLinearAdd, QGemm, ..)
<- ``qfused`` (what ONNX Runtime's optimizer fuses: DynamicQuantizeMatMul, MatMulIntegerToFloat, FusedMatMul,
QAttention) <- ``contrib`` (ONNX Runtime's com.microsoft Gelu family, Skip/SimplifiedLayerNormalization, FusedConv; it
reuses ``layers``' Conv and merges ``qlinear`` and ``qfused``) <- ``importer`` (the op table, ``ONNXModule``, ``import_onnx``); ``quantize``
(ONNX Runtime's static and dynamic quantization) stands alone. Nothing here imports ``onnx`` or ``onnxruntime``
until a model is loaded or calibrated.

Example:
    >>> from overdrive.engine.onnx import SUPPORTED_OPS, import_onnx
    >>> "QuantizeLinear" in SUPPORTED_OPS
    True
    >>> # mod = import_onnx("model.onnx"); y = mod(torch.randn(1, 3, 224, 224))
"""

from overdrive.engine.onnx.importer import SUPPORTED_CONTRIB_OPS, SUPPORTED_OPS, ONNXModule, import_onnx
from overdrive.engine.onnx.quantize import (calibration_feeds, quantizable_nodes, quantize_onnx, quantize_onnx_dynamic,
                                            quantize_onnx_integer)

__all__ = ["import_onnx", "ONNXModule", "SUPPORTED_OPS", "SUPPORTED_CONTRIB_OPS", "quantize_onnx", "quantize_onnx_dynamic", "quantize_onnx_integer",
           "quantizable_nodes", "calibration_feeds"]
