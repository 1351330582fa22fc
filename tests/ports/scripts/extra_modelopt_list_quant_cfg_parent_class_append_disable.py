# source: NVIDIA ModelOpt guide "Quantization Configuration (quant_cfg)": a config built from scratch as an ordered list (from modelopt.torch.quantization.config import _base_disable_all, _default_disabled_quantizer_cfg; {"quantizer_name": ..., "cfg": {...}} entries), a class-scoped entry {"quantizer_name": "*", "parent_class": "nn.Conv2d", "enable": False}, then config["quant_cfg"].append({"quantizer_name": "*head*", "enable": False}) on a copy, mtq.quantize(model, config, forward_loop), mtq.print_quant_summary
# library: modelopt.torch.quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""A small ViT with a list-form ModelOpt config: only the Linear layers of the MLP blocks quantized (int8), the
convolutional patch embedding kept in float by its class, the classifier head kept in float by an appended entry."""
import copy

import torch
import torch.nn as nn

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq
# was: from modelopt.torch.quantization.config import _base_disable_all, _default_disabled_quantizer_cfg
from overdrive.quant.modelopt.config import _base_disable_all, _default_disabled_quantizer_cfg

device = "cuda" if torch.cuda.is_available() else "cpu"
D, CLASSES = 32, 10


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class TinyViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, D, kernel_size=4, stride=4)
        self.blocks = nn.Sequential(MLPBlock(), MLPBlock())
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, 64 patches, D)
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


MLP_INT8_CFG = {
    "quant_cfg": [
        *_base_disable_all,
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None}},
        # the patch embedding sees raw pixels: keep every convolution in float
        {"quantizer_name": "*", "parent_class": "nn.Conv2d", "enable": False},
        *_default_disabled_quantizer_cfg,
    ],
    "algorithm": "max",
}

if __name__ == "__main__":
    torch.manual_seed(0)
    model = TinyViT().to(device).eval()
    float_model = copy.deepcopy(model)
    images = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)
    data_loader = torch.utils.data.DataLoader(images, batch_size=16)

    def forward_loop(model):
        for batch in data_loader:
            model(batch)

    config = copy.deepcopy(MLP_INT8_CFG)
    config["quant_cfg"].append({"quantizer_name": "*head*", "enable": False})  # last entry wins
    model = mtq.quantize(model, config, forward_loop)
    mtq.print_quant_summary(model)

    assert not model.patch_embed.input_quantizer.enabled and not model.patch_embed.weight_quantizer.enabled
    assert not model.head.input_quantizer.enabled and not model.head.weight_quantizer.enabled
    for block in model.blocks:
        for fc in (block.fc1, block.fc2):
            assert fc.input_quantizer.enabled and fc.input_quantizer.amax.dim() == 0  # per tensor, calibrated
            assert fc.weight_quantizer.amax.shape == (fc.out_features,)  # per output channel
    test = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        ref, out = float_model(test), model(test)
    assert not torch.equal(ref, out)  # the MLPs are quantized
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel  # int8 MLPs: logits within 5% of float (relative L2)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
