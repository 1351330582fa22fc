"""mto.restore of a file saved from a 2:4-pruned (then quantized) model: refused before the model is touched, naming
the mask key and the way that restores the pruning too (restore_from_modelopt_state, then sparsity's load_pruned),
which gives back the saved outputs and keeps the masks through an optimizer step."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import overdrive.quant.modelopt as mtq
import overdrive.quant.modelopt.opt as mto
from overdrive import sparsity
from overdrive._utils.errors import UsageError
from overdrive.quant import api
from overdrive.sparsity.api import load_pruned

PRESETS = ["INT8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "FP8_DEFAULT_CFG", "INT8_WEIGHT_ONLY_CFG"]


def _make(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))


def _pruned_quantized(preset: str, path: Path) -> tuple[nn.Module, torch.Tensor]:
    """A pruned model quantized with ``preset`` (its middle layer kept in float), saved with mto.save to ``path``."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    model = _make(0)
    handle = sparsity.sparsify(model)
    cfg = copy.deepcopy(getattr(mtq, preset))
    cfg["quant_cfg"].append({"quantizer_name": "*2*", "enable": False})
    model = mtq.quantize(model, cfg, lambda m: m(x))
    handle.rebind(model)
    mto.save(model, path)
    return model, x


def test_restore_of_a_pruned_file_names_the_mask_and_the_fix(tmp_path: Path) -> None:
    _pruned_quantized("INT8_DEFAULT_CFG", tmp_path / "m.pth")
    fresh = _make(3)
    with pytest.raises(UsageError, match=r"'0\.weight_sparse_mask' and 2 more") as err:
        mto.restore(fresh, tmp_path / "m.pth")
    msg = str(err.value)
    assert "2:4 sparsity masks" in msg and "restore_from_modelopt_state" in msg and "load_pruned" in msg
    assert not list(api.quantizers(fresh)) and type(fresh[0]) is nn.Linear  # left as the float model it was


def test_a_pruned_float_model_saved_with_mto_is_refused_too(tmp_path: Path) -> None:
    model = _make(0)
    sparsity.sparsify(model)
    mto.save(model, tmp_path / "m.pth")
    with pytest.raises(UsageError, match="sparse_mask"):
        mto.restore(_make(3), tmp_path / "m.pth")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_advised_restore_gives_the_saved_outputs_and_keeps_the_masks(tmp_path: Path, preset: str,
                                                                          dtype: torch.dtype) -> None:
    saved, x = _pruned_quantized(preset, tmp_path / "m.pth")
    saved = saved.to(dtype)
    x = x.to(dtype)
    ckpt = torch.load(tmp_path / "m.pth", weights_only=True)
    ckpt["model_state_dict"] = {k: v.to(dtype) if v.is_floating_point() else v
                                for k, v in ckpt["model_state_dict"].items()}
    model = mto.restore_from_modelopt_state(_make(3).to(dtype), ckpt["modelopt_state"])
    handle = load_pruned(model, ckpt["model_state_dict"])
    with torch.no_grad():
        torch.testing.assert_close(model(x), saved(x), atol=1e-6, rtol=0)
    assert {n: q.enabled for n, q in api.quantizers(model)} == {n: q.enabled for n, q in api.quantizers(saved)}
    assert [ly.name for ly in handle.layers] == ["0.weight", "2.weight", "4.weight"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle.attach(opt)
    model(x).float().square().sum().backward()
    opt.step()
    for i in (0, 2, 4):
        w = model[i].weight.detach()
        assert not bool(w[~model[i].weight_sparse_mask].any()), f"layer {i}: a pruned weight moved"
        assert sparsity.is_2to4(w.float())
