"""mto.save / mto.restore and mto.modelopt_state / mto.restore_from_modelopt_state (+ load_state_dict) for every
mtq preset, with edited configs and quantizers switched after quantize, in fp32 and bf16, onto a fresh model built
by the same code with other random weights: the outputs equal the saved model's exactly and every quantizer comes
back enabled or disabled as it was saved."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import overdrive.quant.modelopt as mtq
import overdrive.quant.modelopt.opt as mto
from overdrive.quant import api

PRESETS = ["INT8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "FP8_DEFAULT_CFG", "INT8_WEIGHT_ONLY_CFG"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(1)  # (B, 8 * 4 * 4)
        return self.head(self.fc2(torch.nn.functional.gelu(self.fc1(h))))


def _make(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Net().to(dtype)


def _config(preset: str, edit: str) -> dict[str, Any]:
    cfg = copy.deepcopy(getattr(mtq, preset))
    if edit == "fc2_disabled":
        cfg["quant_cfg"].append({"quantizer_name": "*fc2*", "enable": False})
    elif edit == "per_tensor_weights":
        bits = cfg["quant_cfg"]["*weight_quantizer"]["num_bits"]
        cfg["quant_cfg"].append({"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": bits, "axis": None}})
    elif edit == "head_disabled_dict_style":
        cfg["quant_cfg"]["*head*"] = {"enable": False}
    return cfg


def _enabled(model: nn.Module) -> dict[str, bool]:
    return {name: q.enabled for name, q in api.quantizers(model)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edit", ["fc2_disabled", "per_tensor_weights", "head_disabled_dict_style"])
@pytest.mark.parametrize("preset", PRESETS)
def test_round_trip_is_exact_and_keeps_disabled_quantizers(tmp_path: Path, preset: str, edit: str,
                                                            dtype: torch.dtype) -> None:
    x = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1)).to(dtype)
    model = mtq.quantize(_make(dtype, 0), _config(preset, edit), lambda m: m(x))
    mtq.disable_quantizer(model, "*fc1.weight_quantizer")  # switched off after quantize, amax kept
    with torch.no_grad():
        ref = model(x)
    enabled = _enabled(model)
    assert not enabled["fc1.weight_quantizer"] and any(enabled.values())
    if edit == "fc2_disabled":
        assert not enabled["fc2.weight_quantizer"] and not enabled["fc2.input_quantizer"]

    mto.save(model, tmp_path / "m.pth")
    restored = mto.restore(_make(dtype, 5), tmp_path / "m.pth")
    from_state = mto.restore_from_modelopt_state(_make(dtype, 5), copy.deepcopy(mto.modelopt_state(model)))
    from_state.load_state_dict(model.state_dict())
    for other in (restored, from_state):
        with torch.no_grad():
            out = other(x)
        assert out.dtype == dtype
        assert torch.equal(out, ref)
        assert _enabled(other) == enabled
        if edit == "per_tensor_weights":
            assert other.head.weight_quantizer.amax.numel() == 1
