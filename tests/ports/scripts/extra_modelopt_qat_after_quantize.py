# source: NVIDIA ModelOpt docs "Quantization Aware Training (QAT)": model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop), then the model's own training loop at a lower learning rate with the quantizers in place; mtq.disable_quantizer(model, "*input_quantizer") / mtq.enable_quantizer(...) to compare weight-only; mtq.print_quant_summary
# library: modelopt.torch.quantization
# group: quant
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""ModelOpt PTQ then QAT of a small classifier with a plain training loop."""
import torch
import torch.nn as nn

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq

device = "cuda" if torch.cuda.is_available() else "cpu"


def data(seed, n=2048):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long() + 2 * (x[:, 2] > 0.5).long()
    return x.to(device), y.to(device)


def train(model, x, y, steps, lr):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        i = (step * 64) % len(x)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
        opt.step()


def evaluate(model, x, y):
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x), y).item()


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    x_train, y_train = data(0)
    x_test, y_test = data(1)
    train(model, x_train, y_train, steps=300, lr=3e-3)
    float_loss = evaluate(model, x_test, y_test)

    def forward_loop(model):
        for i in range(0, 256, 64):
            model(x_train[i:i + 64])

    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop)
    mtq.print_quant_summary(model)
    ptq_loss = evaluate(model, x_test, y_test)

    w_before = model[2].weight.detach().clone()
    train(model, x_train, y_train, steps=60, lr=3e-4)  # QAT: the same loop, a tenth of the learning rate
    qat_loss = evaluate(model, x_test, y_test)

    mtq.disable_quantizer(model, "*input_quantizer")
    weight_only_loss = evaluate(model, x_test, y_test)
    mtq.enable_quantizer(model, "*input_quantizer")

    assert not torch.equal(model[2].weight.detach(), w_before)  # gradients reached the weights through fake quant
    assert abs(ptq_loss - float_loss) < 0.1 * float_loss, (float_loss, ptq_loss)
    assert qat_loss < ptq_loss, (ptq_loss, qat_loss)
    assert weight_only_loss != qat_loss and evaluate(model, x_test, y_test) == qat_loss
