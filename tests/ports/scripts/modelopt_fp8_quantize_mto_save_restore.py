# source: NVIDIA ModelOpt docs "Saving & Restoring": model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop); mto.save(model, "modelopt_model.pth"); a freshly built float model restored with mto.restore(model, path); and the two-step form torch.save(mto.modelopt_state(model)) + model.state_dict(), then mto.restore_from_modelopt_state + load_state_dict
# library: modelopt.torch.quantization, modelopt.torch.opt
# group: quant
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""FP8 PTQ of a small conv net, saved and restored both ways on freshly built float models."""
import copy

import torch
import torch.nn as nn

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq
# was: import modelopt.torch.opt as mto
import overdrive.quant.modelopt.opt as mto

device = "cuda" if torch.cuda.is_available() else "cpu"


def get_model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).to(device).eval()


if __name__ == "__main__":
    torch.manual_seed(0)
    model = get_model()
    with torch.no_grad():  # "trained" BatchNorm statistics
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
    float_model = copy.deepcopy(model)
    calib = [torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(i)).to(device) for i in range(4)]

    def forward_loop(model):
        for images in calib:
            model(images)

    model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)
    mto.save(model, "modelopt_model.pth")

    # the one-call form: restore onto the original, unmodified architecture
    torch.manual_seed(123)  # other weights: all of them come from the file
    restored = mto.restore(get_model(), "modelopt_model.pth")

    # the two-step form
    torch.save(mto.modelopt_state(model), "modelopt_state.pth")
    torch.save(model.state_dict(), "model_weights.pth")
    restored2 = get_model()
    restored2 = mto.restore_from_modelopt_state(restored2, torch.load("modelopt_state.pth", weights_only=False))
    restored2.load_state_dict(torch.load("model_weights.pth"))

    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(99)).to(device)
    with torch.no_grad():
        out, ref = model(x), float_model(x)
        # the restored models are the quantized model: bit-identical outputs (tolerance 0)
        assert torch.equal(restored(x), out) and torch.equal(restored2(x), out)
    assert not torch.equal(out, ref)
    # fp8 e4m3 (3 mantissa bits) for weights and activations: logits within 10% of float (relative L2)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.10, rel
