# source: ModelOpt users' ONNX export scripts for TensorRT (attention Q/DQ that mtq.quantize does not place): a QuantizedMatMul module with input1_quantizer / input2_quantizer = modelopt.torch.quantization.nn.TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3))), enable_calib() / disable_quant() in __init__, added lazily with add_module in the attention forward; mtq.quantize(model, FP8_DEFAULT_CFG, forward_loop) for the Linear layers, then load_calib_amax / disable_calib / enable_quant on every quantizer whose _if_calib is set, set_from_attribute_config, mtq.print_quant_summary
# library: modelopt.torch.quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""FP8 attention matmuls quantized by hand beside mtq.quantize's Linear layers."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq
# was: from modelopt.torch.quantization.config import QuantizerAttributeConfig
from overdrive.quant.modelopt.config import QuantizerAttributeConfig
# was: from modelopt.torch.quantization.nn import TensorQuantizer
from overdrive.quant.modelopt.nn import TensorQuantizer

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class QuantizedMatMul(nn.Module):
    """mtq.quantize places no Q/DQ on attention's matmuls, so they get quantizers of their own."""

    def __init__(self):
        super().__init__()
        self.input1_quantizer = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)))
        self.input2_quantizer = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)))
        for q in (self.input1_quantizer, self.input2_quantizer):
            q.enable_calib()
            q.disable_quant()

    def forward(self, input1, input2):
        return torch.matmul(self.input1_quantizer(input1), self.input2_quantizer(input2))


class SelfAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if not hasattr(self, "qk_matmul"):
            self.add_module("qk_matmul", QuantizedMatMul().to(x.device))
        if not hasattr(self, "av_matmul"):
            self.add_module("av_matmul", QuantizedMatMul().to(x.device))
        attn = F.softmax(self.qk_matmul(q, k.transpose(2, 3)) * (c // self.heads) ** -0.5, dim=-1)
        return self.proj(self.av_matmul(attn, v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), SelfAttention(dim)
        self.ln2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


if __name__ == "__main__":
    model = nn.Sequential(Block(), Block()).to(device).eval()
    float_model = copy.deepcopy(model)
    calib_data = [torch.randn(4, 16, 32, device=device) for _ in range(8)]

    def forward_loop(model):
        for x in calib_data:
            model(x)

    with torch.no_grad():
        model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)
        # the attention quantizers were made during calibration, observing: give them their amax
        for name, module in model.named_modules():
            if isinstance(module, TensorQuantizer) and module._if_calib:
                module.load_calib_amax()
                module.disable_calib()
                module.enable_quant()
    mtq.print_quant_summary(model)

    qk = model[0].attn.qk_matmul.input1_quantizer
    assert qk.num_bits == (4, 3) and qk.amax is not None and qk._if_quant and not qk._if_calib
    assert model[1].mlp[0].input_quantizer.num_bits == (4, 3)

    x = torch.randn(4, 16, 32, device=device)
    with torch.no_grad():
        ref, out = float_model(x), model(x)
    cos = F.cosine_similarity(ref.flatten(), out.flatten(), dim=0).item()
    assert 0.99 < cos < 1.0, cos  # quantized (not equal) and close

    # the second block's matmuls in int8 instead: a new format, calibrated again on the data
    for mm in (model[1].attn.qk_matmul, model[1].attn.av_matmul):
        for q in (mm.input1_quantizer, mm.input2_quantizer):
            q.set_from_attribute_config({"num_bits": 8, "axis": None})
            assert q.num_bits == 8 and q.amax is None
            q.disable_quant()
            q.enable_calib()
    with torch.no_grad():
        forward_loop(model)
    for mm in (model[1].attn.qk_matmul, model[1].attn.av_matmul):
        for q in (mm.input1_quantizer, mm.input2_quantizer):
            q.load_calib_amax()
            q.disable_calib()
            q.enable_quant()
    with torch.no_grad():
        out8 = model(x)
    assert F.cosine_similarity(ref.flatten(), out8.flatten(), dim=0).item() > 0.99
    print(f"fp8 attention matmuls: cosine {cos:.5f} to the float model")
