# source: NVIDIA ModelOpt API docs, modelopt.torch.quantization.conversion.register: a QuantLayerNorm subclassing nn.LayerNorm whose _setup() creates input_quantizer / weight_quantizer (modelopt.torch.quantization.nn.TensorQuantizer) and whose forward calls them, mtq.register(original_cls=nn.LayerNorm, quantized_cls=QuantLayerNorm), then mtq.quantize with a deep-copied INT8_DEFAULT_CFG, mtq.print_quant_summary, mtq.unregister
# library: modelopt.torch.quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""Quantize a custom LayerNorm with ModelOpt's register API next to the built-in Linear layers."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq
# was: from modelopt.torch.quantization.nn import TensorQuantizer
from overdrive.quant.modelopt.nn import TensorQuantizer

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class QuantLayerNorm(nn.LayerNorm):
    def __init__(self, normalized_shape):
        super().__init__(normalized_shape)
        self._setup()

    def _setup(self):
        self.input_quantizer = TensorQuantizer()
        self.weight_quantizer = TensorQuantizer()

    def forward(self, input):
        input = self.input_quantizer(input)
        weight = self.weight_quantizer(self.weight)
        return F.layer_norm(input, self.normalized_shape, weight, self.bias, self.eps)


class Mlp(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.lm_head = nn.Linear(d, 10)

    def forward(self, x):
        return self.lm_head(x + self.fc2(F.gelu(self.fc1(self.norm(x)))))


mtq.register(original_cls=nn.LayerNorm, quantized_cls=QuantLayerNorm)

model = Mlp().to(device).eval()
calib = [torch.randn(16, 32, device=device) for _ in range(4)]
with torch.no_grad():
    reference = [model(x) for x in calib]


def forward_loop(model):
    for x in calib:
        model(x)


config = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
config["quant_cfg"]["*norm.weight_quantizer"] = {"num_bits": 8, "axis": None}  # one scale for the norm's weight
model = mtq.quantize(model, config, forward_loop)
mtq.print_quant_summary(model)

assert isinstance(model.norm, QuantLayerNorm)
assert model.norm.input_quantizer.amax is not None and model.norm.weight_quantizer.amax.numel() == 1
assert not model.lm_head.input_quantizer.is_enabled  # "*lm_head*" stays in float, as in the preset
with torch.no_grad():
    for x, ref in zip(calib, reference):
        out = model(x)
        cos = F.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
        assert cos > 0.995, float(cos)

mtq.unregister(nn.LayerNorm)
plain = mtq.quantize(Mlp().to(device), mtq.INT8_DEFAULT_CFG, forward_loop)
assert type(plain.norm) is nn.LayerNorm  # unregistered: LayerNorm is left alone again
print("custom LayerNorm quantized and calibrated")
