"""apex-compatible ASP surface: the recipe, several models per process, errors."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.sparsity import ASP, is_2to4
from overdrive.sparsity import asp as asp_mod


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def test_prune_trained_model_keeps_masks_through_training() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ASP.prune_trained_model(model, opt)
    assert ASP.is_sparsity_enabled(model)
    for _ in range(2):
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert is_2to4(model[0].weight) and is_2to4(model[2].weight)


def test_stepwise_api_several_models_and_restore() -> None:
    a, b = _mlp(), _mlp()
    dense_b = b[0].weight.detach().clone()
    ASP.init_model_for_pruning(a, verbosity=0, allow_permutation=False)
    ASP.init_model_for_pruning(b, "m4n2_2d_greedy", verbosity=0, whitelist=[nn.Linear], allow_recompute_mask=True,
                               allow_permutation=False)
    with pytest.raises(UsageError, match="pass model="):
        ASP.compute_sparse_masks()
    ASP.init_optimizer_for_pruning(torch.optim.SGD(b.parameters(), lr=0.1))
    ASP.compute_sparse_masks(b)
    assert is_2to4(b[0].weight) and not is_2to4(a[0].weight)
    ASP.restore_pruned_weights(b)
    assert torch.equal(b[0].weight, dense_b)
    assert not ASP.is_sparsity_enabled(b)


def test_registry_is_weak() -> None:
    gc.collect()
    n = len(asp_mod._HANDLES)
    m = _mlp()
    ASP.init_model_for_pruning(m, verbosity=0)
    assert len(asp_mod._HANDLES) == n + 1
    del m
    gc.collect()
    assert len(asp_mod._HANDLES) == n


def test_asp_errors() -> None:
    m = _mlp()
    with pytest.raises(UsageError, match="not initialized"):
        ASP.compute_sparse_masks(m)
    with pytest.raises(UsageError, match="owns this optimizer"):
        ASP.init_optimizer_for_pruning(torch.optim.SGD(m.parameters(), lr=0.1))
    ASP.init_model_for_pruning(m, verbosity=0)
    with pytest.raises(UsageError, match="already"):
        ASP.init_model_for_pruning(m, verbosity=0)
    with pytest.raises(UsageError, match="whitelist entry"):
        ASP.init_model_for_pruning(_mlp(), whitelist=[nn.LayerNorm])
    with pytest.raises(UsageError, match="no prunable layer"):
        ASP.init_model_for_pruning(nn.Sequential(nn.Linear(4, 4)), verbosity=0)


class _MyLinear(nn.Linear):
    pass


def test_whitelist_subclass_selects_only_its_instances() -> None:
    # apex: whitelist=[MyLinear] prunes the MyLinear layers; plain Linear layers stay dense
    model = nn.Sequential(_MyLinear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), _MyLinear(32, 16))
    handle = ASP.init_model_for_pruning(model, whitelist=[_MyLinear], verbosity=0, allow_permutation=False,
                                        disallowed_layer_names=["4"])
    assert [layer.name for layer in handle.layers] == ["0.weight"]
    both = nn.Sequential(_MyLinear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    handle = ASP.init_model_for_pruning(both, whitelist=[nn.Linear, _MyLinear], verbosity=0, allow_permutation=False)
    assert [layer.name for layer in handle.layers] == ["0.weight", "2.weight"]


def test_string_layer_names_are_refused() -> None:
    with pytest.raises(UsageError, match="disallowed_layer_names='2' is a string"):
        ASP.init_model_for_pruning(_mlp(), verbosity=0, disallowed_layer_names="2")


def test_torch_save_whole_model_after_asp() -> None:
    import io

    model = _mlp()
    ASP.prune_trained_model(model, torch.optim.SGD(model.parameters(), lr=0.1))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(3, 32)
    assert torch.equal(loaded(x), model(x))  # tolerance 0: same weights, same masks
    bad = {k: v.clone() for k, v in model.state_dict().items()}
    bad["0.weight"].fill_(1.0)  # nonzero where the mask prunes: the loaded copy still checks
    with pytest.raises(UsageError, match="nonzero where its mask prunes"):
        loaded.load_state_dict(bad)
