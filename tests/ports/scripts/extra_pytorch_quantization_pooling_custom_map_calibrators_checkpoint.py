# source: pytorch-quantization docs "Creating Custom Quantized Modules" (the provided QuantMaxPool2d / QuantAvgPool2d / QuantAdaptiveAvgPool2d) and quant_modules.initialize(float_module_list=["Linear"], custom_quant_modules=[(torch.nn, "MaxPool2d", quant_nn.QuantMaxPool2d)]) from its docstring; calib.MaxCalibrator(8, None, False) / calib.HistogramCalibrator(8, None, False) used directly (collect, compute_amax("percentile", percentile=99.9), reset) to set QuantDescriptor(amax=...); QuantDescriptor(num_bits=8, axis=(0)) per-channel weights; TensorQuantizer.num_bits / unsigned / narrow_range / fake_quant / step_size; torch.load of a calibrated pytorch-quantization checkpoint (keys conv1._input_quantizer._amax, per-channel _amax in keep-dims shape) into a freshly built model
# library: pytorch-quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu"); the pytorch-quantization checkpoint is written by a helper here in that library's key names and shapes
"""Quantized pooling, a custom replacement map, calibrators used directly, a pytorch-quantization checkpoint."""
import torch
import torch.nn as nn

# was: from pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import nn as quant_nn
# was: from pytorch_quantization import quant_modules, calib
from overdrive.quant.pytorch_quantization import quant_modules, calib
# was: from pytorch_quantization.tensor_quant import QuantDescriptor
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

device = "cuda" if torch.cuda.is_available() else "cpu"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.pool1 = nn.Conv2d(1, 8, 3, padding=1), nn.MaxPool2d(2)
        self.conv2, self.pool2 = nn.Conv2d(8, 16, 3, padding=1), nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        x = self.pool1(torch.relu(self.conv1(x)))
        x = self.pool2(torch.relu(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def data(seed, n=384):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.3
    x[y == 0, :, :4, :4] += 1.0
    x[y == 1, :, 4:, 4:] += 1.0
    x[y == 2, :, :4, 4:] -= 1.0
    return x.to(device), y.to(device)


def pytorch_quantization_checkpoint(state_dict, model):
    """What model.state_dict() holds under pytorch-quantization: _input_quantizer._amax keys, per-channel amax
    with the reduced dimensions kept ((C, 1, 1, 1) for a conv weight, (C, 1) for a linear one)."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith("quantizer.amax"):
            layer, quantizer, _ = key.rsplit(".", 2)
            if value.dim() == 1:
                weight = model.get_submodule(layer).weight
                value = value.reshape(-1, *[1] * (weight.dim() - 1))
            key = f"{layer}._{quantizer}._amax"
        out[key] = value
    return out


if __name__ == "__main__":
    # calibrators on their own: the range of a tensor, then a quantizer with that fixed amax
    x = torch.randn(10000, generator=torch.Generator().manual_seed(0))
    max_calib = calib.MaxCalibrator(8, None, False)
    max_calib.collect(x)
    hist_calib = calib.HistogramCalibrator(8, None, False, num_bins=2048)
    hist_calib.collect(x)
    amax_max, amax_p = max_calib.compute_amax(), hist_calib.compute_amax("percentile", percentile=99.9)
    assert float(amax_max) == x.abs().max().item()
    assert 3.0 < float(amax_p) < float(amax_max), (amax_p, amax_max)  # the 99.9th percentile of |N(0, 1)|: 3.29
    fixed = quant_nn.TensorQuantizer(QuantDescriptor(num_bits=8, amax=float(amax_p)))
    assert fixed.num_bits == 8 and not fixed.unsigned and fixed.fake_quant and not fixed.narrow_range
    torch.testing.assert_close(fixed.step_size, amax_p / 127)
    assert fixed(x).abs().max() <= amax_p * 128 / 127 + 1e-6  # clipped at amax (-128 steps below zero)
    max_calib.reset()
    assert max_calib.compute_amax() is None

    # a float model trained first ("pretrained")
    torch.manual_seed(0)
    x_train, y_train = data(0)
    x_test, y_test = data(1)
    float_model = Net().to(device)
    opt = torch.optim.Adam(float_model.parameters(), lr=1e-2)
    for step in range(60):
        i = (step * 64) % 384
        opt.zero_grad()
        nn.functional.cross_entropy(float_model(x_train[i:i + 64]), y_train[i:i + 64]).backward()
        opt.step()
    float_model.eval()
    with torch.no_grad():
        float_logits = float_model(x_test)
    float_acc = (float_logits.argmax(1) == y_test).float().mean().item()

    # the quantized model: convs and pools swapped, fc kept in float, MaxPool2d through the custom map
    quant_nn.QuantConv2d.set_default_quant_desc_weight(QuantDescriptor(num_bits=8, axis=(0)))
    quant_modules.initialize(float_module_list=["Linear"],
                             custom_quant_modules=[(torch.nn, "MaxPool2d", quant_nn.QuantMaxPool2d)])
    model = Net().to(device)
    quant_modules.deactivate()
    model.load_state_dict(float_model.state_dict())
    model.eval()
    assert isinstance(model.pool1, quant_nn.QuantMaxPool2d) and isinstance(model.pool2, quant_nn.QuantAdaptiveAvgPool2d)
    assert type(model.fc) is nn.Linear and type(model.conv1).__name__ == "QuantConv2d"
    assert nn.MaxPool2d.__name__ == "MaxPool2d" and nn.Conv2d.__name__ == "Conv2d"  # deactivated

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, quant_nn.TensorQuantizer):
                module.disable_quant()
                module.enable_calib()
        model(x_train[:128])
        for name, module in model.named_modules():
            if isinstance(module, quant_nn.TensorQuantizer):
                module.load_calib_amax()
                module.enable_quant()
                module.disable_calib()
                print(f"{name:30}: {module}")
        logits = model(x_test)
    acc = (logits.argmax(1) == y_test).float().mean().item()
    assert model.pool1._input_quantizer.amax is not None and model.conv2._weight_quantizer.amax.numel() == 16
    assert float_acc > 0.9 and acc >= float_acc - 0.03, (float_acc, acc)
    rel = ((logits - float_logits).norm() / float_logits.norm()).item()
    assert 0 < rel < 0.05, rel

    # a checkpoint written by pytorch-quantization, loaded into a model built the same way
    torch.save(pytorch_quantization_checkpoint(model.state_dict(), model), "quant_net.pth")
    quant_modules.initialize(float_module_list=["Linear"],
                             custom_quant_modules=[(torch.nn, "MaxPool2d", quant_nn.QuantMaxPool2d)])
    restored = Net().to(device)
    quant_modules.deactivate()
    checkpoint = torch.load("quant_net.pth", map_location=device)
    assert "conv1._input_quantizer._amax" in checkpoint and checkpoint["conv1._weight_quantizer._amax"].dim() == 4
    restored.load_state_dict(checkpoint)
    restored.eval()
    with torch.no_grad():
        torch.testing.assert_close(restored(x_test), logits, rtol=0, atol=0)
    assert restored.conv1._weight_quantizer._amax.shape == (8,)  # overdrive keeps a per-channel amax as (C,)
