"""ModelOpt's registry quantizes more layer kinds than quant.quantize swaps: pooling layers get an input quantizer
and ConvTranspose1d / 3d are quantized like ConvTranspose2d. ``mtq.quantize`` with a preset does the same, checked
against a float64 fake-quant reference."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import overdrive.quant.modelopt as mtq
import overdrive.quant.modelopt.opt as mto


def _fq(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """int8 symmetric fake quantization in float64 (amax broadcast against x)."""
    scale = amax.double() / 127
    return torch.clamp(torch.round(x.double() / scale), -128, 127) * scale


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool1d(2)
        self.up = nn.ConvTranspose1d(4, 6, 2, stride=2)
        self.avg = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, L)
        y = self.pool(torch.relu(self.conv(x)))  # (B, 4, L/2)
        y = self.avg(self.up(y))  # (B, 6, 1)
        return self.fc(y.flatten(1))


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, 8, generator=g) for _ in range(3)]


def _quantized() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = _Net().eval()
    model = _Net().eval()
    model.load_state_dict(ref.state_dict())
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: [m(x) for x in _data()])
    return ref, model


def test_pools_and_conv_transpose_1d_get_quantizers_as_in_modelopt() -> None:
    ref, model = _quantized()
    names = {n for n, m in model.named_modules() if isinstance(m, mtq.nn.TensorQuantizer)}
    assert {"pool.input_quantizer", "avg.input_quantizer", "up.input_quantizer", "up.weight_quantizer"} <= names
    assert isinstance(model.pool, nn.MaxPool1d) and isinstance(model.up, nn.ConvTranspose1d)
    assert model.up.weight_quantizer.amax.shape == (6,)  # per output channel (axis 1 of the (4, 6, 2) weight)

    # float64 reference: every quantized input at its calibrated max, weights per output channel
    def reference(x: torch.Tensor, amaxes: dict[str, torch.Tensor]) -> torch.Tensor:
        c, u, f = ref.conv, ref.up, ref.fc
        y = nn.functional.conv1d(_fq(x, amaxes["conv"]), _fq(c.weight, c.weight.abs().amax((1, 2), keepdim=True)),
                                 c.bias.double(), padding=1)
        y = nn.functional.max_pool1d(_fq(torch.relu(y), amaxes["pool"]), 2)
        y = nn.functional.conv_transpose1d(_fq(y, amaxes["up"]), _fq(u.weight, u.weight.abs().amax((0, 2), keepdim=True)),
                                           u.bias.double(), stride=2)
        y = nn.functional.adaptive_avg_pool1d(_fq(y, amaxes["avg"]), 1).flatten(1)
        return nn.functional.linear(_fq(y, amaxes["fc"]), _fq(f.weight, f.weight.abs().amax(1, keepdim=True)),
                                    f.bias.double())

    # activation amax: max |input| of each layer over the calibration data, from hooks on the float model
    seen: dict[str, float] = {}
    hooks = [getattr(ref, n).register_forward_pre_hook(
        lambda mod, args, n=n: seen.__setitem__(n, max(seen.get(n, 0.0), float(args[0].abs().max()))))
        for n in ("conv", "pool", "up", "avg", "fc")]
    with torch.no_grad():
        for x in _data():
            ref(x)
    for h in hooks:
        h.remove()
    for n, amax in seen.items():
        assert float(getattr(model, n).input_quantizer.amax) == pytest.approx(amax, rel=1e-6), n
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(x).double(), reference(x, {n: torch.tensor(a) for n, a in seen.items()}),
                                   rtol=1e-4, atol=1e-5)


def test_grouped_conv_transpose_stays_float() -> None:
    model = nn.Sequential(nn.ConvTranspose1d(4, 4, 2, groups=2), nn.ConvTranspose3d(2, 2, 1))
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG)  # weights only: the two layers take different inputs
    assert type(model[0]) is nn.ConvTranspose1d
    assert isinstance(model[1], nn.ConvTranspose3d) and model[1].weight_quantizer.axis == 1


def test_save_restore_with_pools_and_a_state_saved_without_them(tmp_path: os.PathLike[str]) -> None:
    _, model = _quantized()
    path = os.path.join(tmp_path, "m.pth")
    mto.save(model, path)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        restored = mto.restore(_Net().eval(), path)
        torch.testing.assert_close(restored(x), model(x), rtol=0, atol=0)

    # a state from before pools had quantizers: those come back switched off, the rest as saved
    state = mto.modelopt_state(model)
    for name in ("pool.input_quantizer", "avg.input_quantizer"):
        del state["modelopt_state_dict"][0][1]["quantizers"][name]
    mtq.disable_quantizer(model, "*pool.input_quantizer")
    mtq.disable_quantizer(model, "avg.input_quantizer")
    old = mto.restore_from_modelopt_state(_Net().eval(), state)
    old.load_state_dict({k: v for k, v in model.state_dict().items() if "pool." not in k and "avg." not in k},
                        strict=False)
    assert not old.pool.input_quantizer.is_enabled and not old.avg.input_quantizer.is_enabled
    with torch.no_grad():
        torch.testing.assert_close(old(x), model(x), rtol=0, atol=0)
