# source: NVIDIA ModelOpt PTQ docs and examples of the dict-config releases: config = copy.deepcopy(mtq.INT8_DEFAULT_CFG), config["quant_cfg"]["*weight_quantizer"]["axis"] = None (per-tensor weights), "*classifier*" and a loop of patterns set to {"enable": False} by key, a check with "in", mtq.quantize(model, config, forward_loop) on a CNN (ModelOpt: "For CNN models, only INT8 quantization is supported")
# library: modelopt.torch.quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""A small ResNet-style CNN quantized with the old dict-style edits of an INT8 preset copy: per-tensor int8
weights, the classifier and the downsampling shortcut kept in float."""
import copy

import torch
import torch.nn as nn

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq

device = "cuda" if torch.cuda.is_available() else "cpu"


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.downsample(x))


class SmallResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layer1, self.layer2 = BasicBlock(16, 32, 2), BasicBlock(32, 64, 2)
        self.classifier = nn.Linear(64, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.classifier(x.mean(dim=(2, 3)))


if __name__ == "__main__":
    torch.manual_seed(0)
    model = SmallResNet().to(device).eval()
    float_model = copy.deepcopy(model)
    calib = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)

    def forward_loop(model):
        for batch in calib.split(16):
            model(batch)

    config = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    config["quant_cfg"]["*weight_quantizer"]["axis"] = None  # per-tensor weight scales
    config["quant_cfg"]["*classifier*"] = {"enable": False}
    for pattern in ("*downsample*",):
        config["quant_cfg"][pattern] = {"enable": False}
    assert "*classifier*" in config["quant_cfg"] and config["quant_cfg"]["*downsample*"] == {"enable": False}
    model = mtq.quantize(model, config, forward_loop)

    for name in ("stem.0", "layer1.conv1", "layer1.conv2", "layer2.conv1", "layer2.conv2"):
        conv = model.get_submodule(name)
        assert conv.weight_quantizer.enabled and conv.weight_quantizer.amax.dim() == 0, name  # per tensor
        assert conv.input_quantizer.enabled and conv.input_quantizer.amax is not None, name
    assert not model.classifier.weight_quantizer.enabled and not model.classifier.input_quantizer.enabled
    assert not model.layer1.downsample[0].weight_quantizer.enabled
    test = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        ref, out = float_model(test), model(test)
    assert not torch.equal(ref, out)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel  # per-tensor int8 weights and activations: logits within 5% of float (relative L2)
