# source: pytorch-quantization docs "Basic Functionalities" / "Quantizing by hand" / "Quantization Aware Training": tensor_quant.fake_tensor_quant(x, x.abs().max()) and tensor_quant.tensor_quant(x, amax), quant_nn.QuantLinear(in, out, quant_desc_input=..., quant_desc_weight=tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW), a quant_nn.TensorQuantizer on a residual input in a module's own forward, max calibration with enable_calib / load_calib_amax, then fine-tuning with the quantizers on at a small learning rate
# library: pytorch-quantization
# group: quant
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""Quantized layers placed by hand, calibrated, then QAT fine-tuning, plus the fake-quant functions."""
import torch
import torch.nn as nn

# was: from pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import nn as quant_nn
# was: from pytorch_quantization import tensor_quant
from overdrive.quant.pytorch_quantization import tensor_quant
# was: from pytorch_quantization.tensor_quant import QuantDescriptor
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

device = "cuda" if torch.cuda.is_available() else "cpu"


class QuantResidualMLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        quant_desc_input = QuantDescriptor(num_bits=8, calib_method="max")
        self.fc1 = quant_nn.QuantLinear(d, 2 * d, quant_desc_input=quant_desc_input,
                                        quant_desc_weight=tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW)
        self.fc2 = quant_nn.QuantLinear(2 * d, d, quant_desc_input=quant_desc_input,
                                        quant_desc_weight=tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW)
        self.head = quant_nn.QuantLinear(d, 4)
        self.residual_quantizer = quant_nn.TensorQuantizer(quant_desc_input)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(x)))
        return self.head(self.residual_quantizer(x) + h)


def data(seed, n=1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return x.to(device), (x[:, :4] * 2 + torch.relu(x[:, 4:8]) * 3).to(device)


if __name__ == "__main__":
    # the fake-quant functions on their own, as the docs open with
    torch.manual_seed(12345)
    x = torch.rand(10)
    fake_quant_x = tensor_quant.fake_tensor_quant(x, x.abs().max())
    quant_x, scale = tensor_quant.tensor_quant(x, x.abs().max())
    assert torch.equal(quant_x, quant_x.round()) and quant_x.abs().max() <= 127
    torch.testing.assert_close(quant_x / scale, fake_quant_x)
    assert (fake_quant_x - x).abs().max() <= x.abs().max() / 127 / 2 + 1e-7  # half a step of the 8-bit grid

    torch.manual_seed(0)
    model = QuantResidualMLP().to(device)
    x_train, y_train = data(0)
    x_test, y_test = data(1)

    # float training first (quantizers off), as for a pretrained model
    for module in model.modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            module.disable()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(300):
        i = (step * 64) % 1024
        opt.zero_grad()
        nn.functional.mse_loss(model(x_train[i:i + 32]), y_train[i:i + 32]).backward()
        opt.step()
    with torch.no_grad():
        float_out = model(x_test)
        float_loss = nn.functional.mse_loss(float_out, y_test).item()

    # calibrate (max) with quantization off, then turn quantization on
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, quant_nn.TensorQuantizer):
                module.enable()
                module.disable_quant()
                module.enable_calib()
        model(x_train)
        for module in model.modules():
            if isinstance(module, quant_nn.TensorQuantizer):
                module.load_calib_amax()
                module.enable_quant()
                module.disable_calib()
        ptq_out = model(x_test)
        ptq_loss = nn.functional.mse_loss(ptq_out, y_test).item()

    # QAT: fine-tune with the quantizers on, at a small learning rate
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for step in range(60):
        i = (step * 64) % 1024
        opt.zero_grad()
        nn.functional.mse_loss(model(x_train[i:i + 32]), y_train[i:i + 32]).backward()
        opt.step()
    with torch.no_grad():
        qat_loss = nn.functional.mse_loss(model(x_test), y_test).item()

    assert model.fc1._weight_quantizer.amax.numel() == 64 and model.residual_quantizer.amax.numel() == 1
    # int8 everywhere: outputs within 3% of float (relative L2), but not equal to them
    rel = ((ptq_out - float_out).norm() / float_out.norm()).item()
    assert 0 < rel < 0.03, rel
    assert float_loss < 0.5 and ptq_loss > float_loss, (float_loss, ptq_loss)
    assert qat_loss < ptq_loss, (float_loss, ptq_loss, qat_loss)
