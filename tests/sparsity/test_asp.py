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
    with pytest.raises(UsageError, match=r"whitelist=.*Linear.* not a list .* whitelist=\[Linear\]"):
        ASP.init_model_for_pruning(_mlp(), whitelist=nn.Linear)  # one class, not a list: was a bare TypeError
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


def test_the_permutation_reorders_the_optimizer_state_with_the_weights() -> None:
    """Reference: each moved weight row carries its own Adam moments. Before, the weights moved and the moments
    stayed, so fine-tuning updated each channel with another channel's moments."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(8, 32)).pow(2).sum().backward()
        opt.step()
    w0, ea0 = m[0].weight.detach().clone(), opt.state[m[0].weight]["exp_avg"].clone()
    c0 = opt.state[m[2].weight]["exp_avg_sq"].clone()
    ASP.init_model_for_pruning(m, verbosity=0, disallowed_layer_names=["0"])
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks(m)
    w1 = m[0].weight.detach()
    src = [int((w0 == w1[i]).all(1).nonzero()) for i in range(64)]
    assert src != list(range(64))  # the permutation moved rows
    assert torch.equal(opt.state[m[0].weight]["exp_avg"], ea0[src])
    assert torch.equal(opt.state[m[2].weight]["exp_avg_sq"], c0[:, src])  # the consumer's columns too
    ASP._handle(m).remove()


def test_an_optimizer_with_state_attached_after_the_permutation_is_refused() -> None:
    from overdrive.sparsity import SparsityConfig, sparsify

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(8, 32)).sum().backward()
    opt.step()
    handle = sparsify(m, SparsityConfig(permutation=True))  # this optimizer's moments stay in the old order
    assert handle.permutation["groups"] == 1
    with pytest.raises(UsageError, match=r"holds state .* for \['0.bias', '0.weight', '2.weight'\].*attach it before"):
        handle.attach(opt)


def test_weight_norm_and_tied_disallowed_layers_are_skipped_with_the_reason() -> None:
    """Before: a weight_norm layer was reported pruned and stayed dense (its weight is recomputed each forward);
    a weight tied between a pruned and a disallowed layer was pruned through the first, with no word."""
    from torch.nn.utils.parametrizations import weight_norm

    from overdrive.sparsity import SparsityConfig, sparsify

    torch.manual_seed(0)
    m = nn.Sequential(weight_norm(nn.Linear(32, 64)), nn.ReLU(), nn.Linear(64, 16))
    h = sparsify(m, SparsityConfig())
    assert [layer.name for layer in h.layers] == ["2.weight"]
    assert any(d["name"] == "0.weight" and "weight_norm or a parametrization" in d["reason"] for d in h.report().skipped)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = nn.Linear(32, 32), nn.Linear(32, 32)
            self.dec.weight = self.enc.weight

    t = Tied()
    with pytest.raises(UsageError, match=r"no prunable layer.*weight tied to 'dec', which is in disallowed_layer_names"):
        ASP.init_model_for_pruning(t, verbosity=0, disallowed_layer_names=["dec"])
    assert float((t.enc.weight == 0).float().mean()) == 0.0


def test_apex_asp_faces() -> None:
    """prune_trained_model prunes what apex's does (Linear and Conv2d); is_sparsity_enabled is False before any
    init; an optimizer of an initialized model holding no pruned weight is accepted; create_mask and the asp
    submodule import as in apex."""
    from overdrive.apex.contrib.sparsity import create_mask
    from overdrive.apex.contrib.sparsity.asp import ASP as ASP2

    assert ASP2 is ASP
    assert create_mask(torch.tensor([[0.1, -3.0, 2.0, 0.2]])).tolist() == [[0.0, 1.0, 1.0, 0.0]]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(16, 32, 3)
            self.att = nn.MultiheadAttention(32, 4, batch_first=True)

    n = Net()
    ASP.prune_trained_model(n, torch.optim.SGD(n.parameters(), lr=0.1))
    assert [p["name"] for p in ASP.handle(n).report().pruned] == ["att.out_proj.weight"]
    ASP.handle(n).remove()

    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    m[0].requires_grad_(False)
    ASP.init_model_for_pruning(m, verbosity=0)
    ASP.init_optimizer_for_pruning(torch.optim.SGD([q for q in m.parameters() if q.requires_grad], lr=0.1))
    with pytest.raises(UsageError, match="owns this optimizer"):  # another model's optimizer
        ASP.init_optimizer_for_pruning(torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1))


def test_a_pruned_model_saved_whole_resumes_fine_tuning_through_asp() -> None:
    """``torch.save(model)`` of a pruned model, loaded: init_model_for_pruning said "already pruned" and
    init_optimizer_for_pruning "init first", so the fine-tuning could not resume with its masks. Now the masks the
    model carries are adopted and kept through the optimizer's steps."""
    import io

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    ASP.init_model_for_pruning(m, verbosity=0, allow_permutation=False)
    ASP.init_optimizer_for_pruning(torch.optim.SGD(m.parameters(), lr=0.1))
    ASP.compute_sparse_masks(m)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m2 = torch.load(buf, weights_only=False)
    masks = [m2[0].weight_sparse_mask.clone(), m2[2].weight_sparse_mask.clone()]
    ASP.init_model_for_pruning(m2, verbosity=0)
    opt = torch.optim.SGD(m2.parameters(), lr=0.5, momentum=0.9)
    ASP.init_optimizer_for_pruning(opt)
    for _ in range(5):
        opt.zero_grad()
        m2(torch.randn(8, 32)).pow(2).sum().backward()
        opt.step()
    for layer, mask in zip((m2[0], m2[2]), masks):
        assert torch.equal(layer.weight_sparse_mask, mask) and bool((layer.weight[~mask] == 0).all())
    assert ASP.is_sparsity_enabled(m2)
    ASP._handle(m).remove()
    ASP._handle(m2).remove()


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
], ids=["adam", "adamw_foreach", "adamw_loop"])
def test_a_half_model_trained_with_adam_keeps_exact_zeros_and_finite_outputs(make_opt) -> None:
    # fp16 Adam: a pruned position's gradient is zeroed, its moments stay 0 and eps=1e-8 underflows to 0 in fp16,
    # so the step writes 0 / 0 = NaN there; the masks must put 0 back (NaN * 0 stays NaN: every output was NaN)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32)).half()
    x, target = torch.randn(8, 32).half(), torch.randn(8, 32).half()
    dense = nn.Sequential(nn.Linear(32, 32)).half()
    dense.load_state_dict(model.state_dict())
    opt, dense_opt = make_opt(model.parameters()), make_opt(dense.parameters())
    ASP.prune_trained_model(model, opt)
    for m, o in ((model, opt), (dense, dense_opt)):
        for _ in range(3):
            o.zero_grad()
            (m(x).float() - target.float()).square().sum().backward()
            o.step()
    assert bool(torch.isfinite(dense(x)).all())  # the reference: this fp16 Adam run is sound without pruning
    w, mask = model[0].weight, model[0].weight_sparse_mask
    assert bool((w[~mask] == 0).all()) and bool(torch.isfinite(w).all())
    assert bool(torch.isfinite(model(x)).all())


@pytest.mark.parametrize("wrap", [torch.compile, nn.DataParallel], ids=["compile", "data_parallel"])
def test_calls_on_the_wrapped_model_find_the_one_initialized(wrap) -> None:
    # init_model_for_pruning(model), then the script wraps it (DDP, DataParallel, torch.compile) and keeps calling ASP
    # with what it trains: that said "not initialized"
    model = _mlp()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    wrapped = wrap(model)
    ASP.compute_sparse_masks(wrapped)
    assert ASP.is_sparsity_enabled(wrapped) and ASP.already_init_asp_model(wrapped)
    assert is_2to4(model[0].weight) and ASP.handle(wrapped) is ASP.handle(model)
    with pytest.raises(UsageError, match="already"):
        ASP.init_model_for_pruning(wrapped, verbosity=0)
    with pytest.raises(UsageError, match="was not initialized"):
        ASP.is_sparsity_enabled(wrap(_mlp()))
