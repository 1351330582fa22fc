# source: TensorRT's pytorch-quantization examples (calibrate_quant_resnet50 / the quantization tutorial): QuantDescriptor(calib_method='histogram') set with quant_nn.QuantConv2d / QuantLinear.set_default_quant_desc_input, quant_modules.initialize() before the model (and its pretrained weights) are built, collect_stats() and compute_amax() over quant_nn.TensorQuantizer with _calibrator / disable_quant / enable_calib / load_calib_amax(method="percentile", percentile=99.99), evaluate, torch.save(model.state_dict()), then "mse" and "entropy" from the same histograms
# library: pytorch-quantization
# group: quant
# device: written device-agnostic (device = "cuda" if available else "cpu") where the sample calls model.cuda() / image.cuda(); a small ResNet built here stands in for torchvision's resnet50(pretrained=True)
"""The TensorRT sample's PTQ flow on a small ResNet: histogram calibration, percentile / mse / entropy amax."""
import torch
import torch.nn as nn

# was: from pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import nn as quant_nn
# was: from pytorch_quantization import quant_modules
from overdrive.quant.pytorch_quantization import quant_modules
# was: from pytorch_quantization.tensor_quant import QuantDescriptor
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor
# was: from pytorch_quantization import calib
from overdrive.quant.pytorch_quantization import calib

device = "cuda" if torch.cuda.is_available() else "cpu"


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class ResNet(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.layer1 = BasicBlock(16)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def dataset(seed, n):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4
    x = torch.randn(n, 3, 8, 8, generator=g) * 0.5
    x[torch.arange(n), y % 3] += 1.0
    x[:, :, :4] += (y // 3).float().view(-1, 1, 1, 1)
    return torch.utils.data.TensorDataset(x, y)


def pretrained_state_dict():
    """What resnet50(pretrained=True) downloads: weights of a float model trained beforehand."""
    torch.manual_seed(0)
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in torch.utils.data.DataLoader(dataset(0, 512), batch_size=32):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def collect_stats(model, data_loader, num_batches):
    """Feed data to the network and collect statistic"""
    # Enable calibrators
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if module._calibrator is not None:
                module.disable_quant()
                module.enable_calib()
            else:
                module.disable()
    for i, (image, _) in enumerate(data_loader):
        model(image.to(device))
        if i >= num_batches:
            break
    # Disable calibrators
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if module._calibrator is not None:
                module.enable_quant()
                module.disable_calib()
            else:
                module.enable()


def compute_amax(model, **kwargs):
    # Load calib result
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if module._calibrator is not None:
                if isinstance(module._calibrator, calib.MaxCalibrator):
                    module.load_calib_amax()
                else:
                    module.load_calib_amax(**kwargs)
            print(F"{name:40}: {module}")
    model.to(device)


def evaluate(model, data_loader):
    model.eval()
    correct, logits = 0, []
    with torch.no_grad():
        for image, target in data_loader:
            output = model(image.to(device))
            correct += (output.argmax(1) == target.to(device)).sum().item()
            logits.append(output)
    return correct / len(data_loader.dataset), torch.cat(logits)


if __name__ == "__main__":
    state_dict = pretrained_state_dict()
    data_loader = torch.utils.data.DataLoader(dataset(1, 256), batch_size=32, shuffle=True,
                                              generator=torch.Generator().manual_seed(0))
    data_loader_test = torch.utils.data.DataLoader(dataset(2, 128), batch_size=64)
    float_model = ResNet().to(device)
    float_model.load_state_dict(state_dict)
    float_acc, float_logits = evaluate(float_model, data_loader_test)

    quant_desc_input = QuantDescriptor(calib_method="histogram")
    quant_nn.QuantConv2d.set_default_quant_desc_input(quant_desc_input)
    quant_nn.QuantLinear.set_default_quant_desc_input(quant_desc_input)
    quant_modules.initialize()
    model = ResNet()
    model.load_state_dict(state_dict)
    model.to(device)
    model.eval()  # calibrate with the BatchNorm running statistics, not batch statistics
    quant_modules.deactivate()

    # It is a bit slow since we collect histograms on CPU
    with torch.no_grad():
        collect_stats(model, data_loader, num_batches=2)
        compute_amax(model, method="percentile", percentile=99.99)
    acc, logits = evaluate(model, data_loader_test)
    # Save the model
    torch.save(model.state_dict(), "quant_resnet-calibrated.pth")

    assert type(model.conv1).__name__ == "QuantConv2d" and type(model.fc).__name__ == "QuantLinear"
    assert isinstance(model.conv1._input_quantizer._calibrator, calib.HistogramCalibrator)
    assert isinstance(model.conv1._weight_quantizer._calibrator, calib.MaxCalibrator)
    assert nn.Conv2d.__name__ == "Conv2d" and not issubclass(nn.Conv2d, quant_nn.QuantConv2d)  # deactivated
    # int8 fake quantization costs at most 2 points of accuracy here, and moves the logits < 5% (relative L2)
    assert float_acc > 0.9 and acc >= float_acc - 0.02, (float_acc, acc)
    rel = ((logits - float_logits).norm() / float_logits.norm()).item()
    assert 0 < rel < 0.05, rel
    saved = torch.load("quant_resnet-calibrated.pth")
    assert any(k.endswith("amax") for k in saved), sorted(saved)[:8]

    with torch.no_grad():
        for method in ["mse", "entropy"]:
            print(F"{method} calibration")
            compute_amax(model, method=method)
            acc_m, logits_m = evaluate(model, data_loader_test)
            assert acc_m >= float_acc - 0.02, (method, acc_m, float_acc)
            assert ((logits_m - float_logits).norm() / float_logits.norm()).item() < 0.05, method
