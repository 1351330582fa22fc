# source: pytorch-quantization docs "Creating Custom Quantized Modules": QuantMaxPool2d(pooling.MaxPool2d, _utils.QuantInputMixin) and QuantLinear(nn.Linear, _utils.QuantMixin) with pop_quant_desc_in_kwargs / init_quantizer / _input_quantizer / _weight_quantizer and the input_quantizer / weight_quantizer getters, used in a model, calibrated with the TensorRT samples' collect_stats / compute_amax loop
# library: pytorch-quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""Custom quantized modules written as in pytorch-quantization's tutorial, then calibrated and evaluated."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import pooling

# was: from pytorch_quantization import calib
from overdrive.quant.pytorch_quantization import calib
# was: from pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import nn as quant_nn
# was: from pytorch_quantization.nn.modules import _utils
from overdrive.quant.pytorch_quantization.nn.modules import _utils
# was: from pytorch_quantization.tensor_quant import QuantDescriptor
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class QuantMaxPool2d(pooling.MaxPool2d, _utils.QuantInputMixin):
    """Quantized 2D maxpool"""
    def __init__(self, kernel_size, stride=None, padding=0, dilation=1,
                 return_indices=False, ceil_mode=False, **kwargs):
        super(QuantMaxPool2d, self).__init__(kernel_size, stride, padding, dilation,
                                             return_indices, ceil_mode)
        quant_desc_input = _utils.pop_quant_desc_in_kwargs(self.__class__, input_only=True, **kwargs)
        self.init_quantizer(quant_desc_input)

    def forward(self, input):
        quant_input = self._input_quantizer(input)
        return super(QuantMaxPool2d, self).forward(quant_input)

    @property
    def input_quantizer(self):
        return self._input_quantizer


class QuantLinear(nn.Linear, _utils.QuantMixin):

    def __init__(self, in_features, out_features, bias=True, **kwargs):
        super(QuantLinear, self).__init__(in_features, out_features, bias)
        quant_desc_input, quant_desc_weight = _utils.pop_quant_desc_in_kwargs(self.__class__, **kwargs)

        self.init_quantizer(quant_desc_input, quant_desc_weight)

    def forward(self, input):
        quant_input = self._input_quantizer(input)
        quant_weight = self._weight_quantizer(self.weight)

        output = F.linear(quant_input, quant_weight, bias=self.bias)

        return output

    @property
    def input_quantizer(self):
        return self._input_quantizer

    @property
    def weight_quantizer(self):
        return self._weight_quantizer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = quant_nn.QuantConv2d(1, 8, 3, padding=1)
        self.pool = QuantMaxPool2d(2, quant_desc_input=QuantDescriptor(calib_method="histogram"))
        self.fc = QuantLinear(8 * 4 * 4, 10, quant_desc_weight=QuantDescriptor(num_bits=8, axis=(0,)))

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(F.relu(self.conv(x))), 1))


model = Net().to(device).eval()
images = [torch.randn(32, 1, 8, 8, device=device) for _ in range(4)]


def set_quant(model, on):
    for module in model.modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            module.enable_quant() if on else module.disable_quant()


def collect_stats(model, data):
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            module.disable_quant()
            module.enable_calib()
    for x in data:
        model(x)
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            module.enable_quant()
            module.disable_calib()


def compute_amax(model, **kwargs):
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if isinstance(module._calibrator, calib.MaxCalibrator):
                module.load_calib_amax()
            else:
                module.load_calib_amax(**kwargs)


with torch.no_grad():
    set_quant(model, False)
    reference = [model(x) for x in images]
    collect_stats(model, images)
    compute_amax(model, method="percentile", percentile=99.99)
    quantized = [model(x) for x in images]

assert isinstance(model.fc.weight_quantizer, quant_nn.TensorQuantizer)
assert model.fc.weight_quantizer.amax.shape == (10,)  # per row: the weight quantizer saw the weight in forward
assert torch.equal(model.fc.weight_quantizer.amax, model.fc.weight.detach().abs().amax(1))
assert isinstance(model.pool._input_quantizer._calibrator, calib.HistogramCalibrator)
keys = model.state_dict().keys()
assert "fc._input_quantizer._amax" in keys or "fc._input_quantizer.amax" in keys
for q, r in zip(quantized, reference):
    cos = F.cosine_similarity(q.flatten(), r.flatten(), dim=0)
    assert cos > 0.99, float(cos)
print("custom quantized modules calibrated:", model.fc.input_quantizer)
