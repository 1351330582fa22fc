# source: pytorch-quantization docs and its VGG test model: layers built directly as quant_nn.Conv2d(n_chan, v, kernel_size=3, padding=1, quant_desc_input=, quant_desc_weight=) / quant_nn.MaxPool2d(kernel_size=2, stride=2, quant_desc_input=) / quant_nn.Linear (the aliases without the Quant prefix), QuantDescriptor(calib_method="histogram"), a collect_stats loop that sets module._if_quant / module._if_calib and reads them back, load_calib_amax("percentile", percentile=99.99), then QAT with SGD
# library: pytorch-quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""A VGG-style network built from pytorch-quantization's layers, calibrated, then fine-tuned (QAT)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

# was: from pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import nn as quant_nn
# was: from pytorch_quantization import tensor_quant
from overdrive.quant.pytorch_quantization import tensor_quant
# was: from pytorch_quantization.tensor_quant import QuantDescriptor
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

CFG = [8, "M", 16, "M", 32]


class QuantVGG(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        quant_desc_input = QuantDescriptor(num_bits=8, calib_method="histogram")
        quant_desc_weight = tensor_quant.QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL
        layers, n_chan = [], 3
        for v in CFG:
            if v == "M":
                layers += [quant_nn.MaxPool2d(kernel_size=2, stride=2, quant_desc_input=quant_desc_input)]
            else:
                conv2d = quant_nn.Conv2d(n_chan, v, kernel_size=3, padding=1,
                                         quant_desc_input=quant_desc_input, quant_desc_weight=quant_desc_weight)
                layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                n_chan = v
        self.features = nn.Sequential(*layers)
        self.pool = quant_nn.AdaptiveAvgPool2d((1, 1), quant_desc_input=quant_desc_input)
        self.classifier = quant_nn.Linear(n_chan, num_classes, quant_desc_input=quant_desc_input,
                                          quant_desc_weight=tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def collect_stats(model, data, num_batches):
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            module._if_quant = False
            module._if_calib = True
    with torch.no_grad():
        for i, (images, _) in enumerate(data):
            model(images.to(device))
            if i + 1 >= num_batches:
                break
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer) and module._if_calib:
            module._if_calib = False
            module._if_quant = True


def compute_amax(model, **kwargs):
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if module.axis is not None:
                module.load_calib_amax()
            else:
                module.load_calib_amax(**kwargs)


if __name__ == "__main__":
    # a small task: which quadrant of the image is bright
    def batch(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 3, 16, 16, generator=g) * 0.3
        y = torch.randint(0, 4, (n,), generator=g)
        for i, c in enumerate(y.tolist()):
            r, s = divmod(c, 2)
            x[i, :, r * 8:(r + 1) * 8, s * 8:(s + 1) * 8] += 1.0
        return x, y

    train = [batch(32, i) for i in range(20)]
    model = QuantVGG().to(device)
    assert isinstance(model.features[0], quant_nn.QuantConv2d) and isinstance(model.features[3], quant_nn.QuantMaxPool2d)

    # float pre-training: quantizers off
    for module in model.modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            module.disable()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        for x, y in train:
            opt.zero_grad()
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
    for module in model.modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            module.enable()

    model.eval()
    collect_stats(model, train, num_batches=8)
    compute_amax(model, method="percentile", percentile=99.99)
    quantizers = [m for m in model.modules() if isinstance(m, quant_nn.TensorQuantizer)]
    assert all(q._amax is not None and q._if_quant and not q._if_calib for q in quantizers)

    def accuracy(m):
        x, y = batch(256, 1000)
        with torch.no_grad():
            return (m(x.to(device)).argmax(1).cpu() == y).float().mean().item()

    ptq = accuracy(model)

    # QAT: the straight-through gradient reaches every weight, amax stays fixed
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    amax_before = model.classifier._input_quantizer._amax.clone()
    for x, y in train[:10]:
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        assert model.features[0].weight.grad.abs().sum() > 0
        opt.step()
    assert torch.equal(model.classifier._input_quantizer._amax, amax_before)
    model.eval()
    qat = accuracy(model)
    print(f"PTQ accuracy {ptq:.3f}, after QAT {qat:.3f}")
    assert ptq > 0.9 and qat > 0.9, (ptq, qat)
