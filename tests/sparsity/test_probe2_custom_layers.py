"""apex's custom_layer_dict (SparsityConfig.custom_layers) and loading a pruned
state_dict into a fresh model (load_pruned)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity import SparsityConfig, is_2to4, sparsify
from overdrive.sparsity.api import load_pruned
from overdrive.sparsity.masks import m4n2_1d


class MyLinear(nn.Module):
    """A GEMM layer that is no nn.Linear subclass (apex's custom_layer_dict case)."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i))
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MyLinear(32, 16), nn.ReLU(), nn.Linear(16, 8))


def test_custom_layer_is_pruned_like_apex_m4n2_1d() -> None:
    model = _net()
    dense = model[0].weight.detach().clone()
    handle = sparsify(model, SparsityConfig(custom_layers={MyLinear: ["weight"]}))
    assert [(p["name"], p["type"]) for p in handle.report().pruned] == [("0.weight", "MyLinear"), ("2.weight", "Linear")]
    # the reference: keep the 2 largest |w| of every 4 along the input dim, as apex's m4n2_1d does
    ref = dense * m4n2_1d(dense)
    torch.testing.assert_close(model[0].weight.detach(), ref, atol=0, rtol=0)
    assert is_2to4(model[0].weight)
    cfg = handle.config
    assert SparsityConfig.from_json(cfg.to_json()) == cfg  # the class is kept by name: the config stays JSON


def test_custom_layer_without_config_stays_dense_and_bad_name_is_named() -> None:
    model = _net()
    handle = sparsify(model)
    assert [p["name"] for p in handle.report().pruned] == ["2.weight"]
    with pytest.raises(UsageError, match=r"wieght.*MyLinear.*\['weight', 'bias'\]"):
        sparsify(_net(), SparsityConfig(custom_layers={MyLinear: ["wieght"]}))
    with pytest.raises(UsageError, match="list of parameter names"):
        SparsityConfig(custom_layers={MyLinear: "weight"})


def test_default_config_json_is_unchanged_by_the_new_field() -> None:
    assert "custom_layers" not in SparsityConfig().to_json()  # checkpoints written before read the same


def test_pruned_state_dict_loads_into_a_fresh_model() -> None:
    pruned = _net()
    sparsify(pruned, SparsityConfig(custom_layers={MyLinear: ["weight"]}))
    sd = pruned.state_dict()
    with pytest.raises(RuntimeError, match="_sparse_mask"):  # plain torch stops at the mask keys
        _net().load_state_dict(sd)
    fresh = _net()
    handle = load_pruned(fresh, sd, SparsityConfig(custom_layers={MyLinear: ["weight"]}))
    assert sorted(ly.name for ly in handle.layers) == ["0.weight", "2.weight"]
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fresh(x), pruned(x), atol=0, rtol=0)
    opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
    handle.attach(opt)
    fresh(x).sum().backward()
    opt.step()
    assert is_2to4(fresh[0].weight) and is_2to4(fresh[2].weight)  # the masks keep applying after a step


def test_load_pruned_errors_say_what_to_do() -> None:
    pruned = _net()
    sparsify(pruned, SparsityConfig(custom_layers={MyLinear: ["weight"]}))
    with pytest.raises(UsageError, match="custom_layers"):  # the custom layer's mask, config not given
        load_pruned(_net(), pruned.state_dict())
    with pytest.raises(UsageError, match="no 2:4 masks"):
        load_pruned(_net(), _net().state_dict())
    fresh = _net()
    bad = dict(pruned.state_dict())
    bad["2.weight"] = torch.ones(8, 16)  # nonzero where the mask prunes
    with pytest.raises(UsageError, match="nonzero where its mask prunes"):
        load_pruned(fresh, bad, SparsityConfig(custom_layers={MyLinear: ["weight"]}))
    assert not any(n.endswith("_sparse_mask") for n, _ in fresh.named_buffers())
