# source: TensorRT's pytorch-quantization examples, export step: quant_nn.TensorQuantizer.use_fb_fake_quant = True, then torch.onnx.export(model, dummy_input, "quant_model.onnx", opset_version=13) for TensorRT to read the QuantizeLinear/DequantizeLinear pairs
# library: pytorch-quantization
# group: quant
# count: extra
"""The TensorRT sample's ONNX export of a calibrated pytorch-quantization model."""
import onnx
import torch
import torch.nn as nn

# was: from pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import nn as quant_nn
# was: from pytorch_quantization import quant_modules
from overdrive.quant.pytorch_quantization import quant_modules

if __name__ == "__main__":
    quant_modules.initialize()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).eval()
    quant_modules.deactivate()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, quant_nn.TensorQuantizer):
                m.disable_quant()
                m.enable_calib()
        model(torch.randn(16, 3, 8, 8))
        for m in model.modules():
            if isinstance(m, quant_nn.TensorQuantizer):
                m.load_calib_amax()
                m.enable_quant()
                m.disable_calib()

    quant_nn.TensorQuantizer.use_fb_fake_quant = True
    try:
        dummy_input = torch.randn(1, 3, 8, 8)
        torch.onnx.export(model, dummy_input, "quant_model.onnx", opset_version=13, dynamo=False)
    finally:
        quant_nn.TensorQuantizer.use_fb_fake_quant = False
    ops = [n.op_type for n in onnx.load("quant_model.onnx").graph.node]
    assert ops.count("QuantizeLinear") >= 4 and ops.count("DequantizeLinear") >= 4, ops
