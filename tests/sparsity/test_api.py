"""sparsify(): layer discovery and skip rules, masks held through optimizers (foreach, fused, amp
O2 masters), gradient accumulation, checkpoint/resume, several models, report, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive import amp
from overdrive._utils.errors import UsageError
from overdrive.sparsity import SparsityConfig as Config, PRESETS, from_pruned, is_2to4, sparsify


class MyLinear(nn.Linear):  # a subclass: apex ASP missed these
    pass


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), MyLinear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _zero_where_pruned(handle) -> bool:
    return all(bool((layer.weight[~layer.mask] == 0).all()) for layer in handle.layers)


def test_finds_layers_and_states_skip_reasons() -> None:
    model = nn.Sequential(nn.Conv2d(16, 32, 3), nn.Conv2d(32, 32, 3, groups=4), nn.Flatten(), nn.Linear(32, 10),
                          nn.Conv1d(3, 8, 1))
    handle = sparsify(model)
    assert [layer.name for layer in handle.layers] == ["0.weight"]
    reasons = {s.name: s.skip_reason for s in handle.skipped}
    assert "grouped convolution" in reasons["1.weight"]
    assert "out % 8" in reasons["3.weight"]  # 10 outputs
    assert "in % 16" in reasons["4.weight"]


def test_subclass_and_mha_are_pruned() -> None:
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(32, 4), "mlp": _mlp()})
    handle = sparsify(model)
    names = {layer.name for layer in handle.layers}
    assert {"attn.in_proj_weight", "attn.out_proj.weight", "mlp.0.weight", "mlp.2.weight"} <= names
    assert all(is_2to4(layer.weight) for layer in handle.layers)


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
], ids=["sgd-foreach", "adamw-loop", "adamw-fused", "adam-foreach"])
def test_masks_survive_optimizer_steps(make_opt) -> None:
    model = _mlp()
    handle = sparsify(model)
    opt = make_opt(model.parameters())
    handle.attach(opt)
    masks = {k: v.clone() for k, v in handle.masks().items()}
    for _ in range(3):
        loss = model(torch.randn(16, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert _zero_where_pruned(handle)
    assert all(torch.equal(masks[k], v) for k, v in handle.masks().items())
    # kept weights did train
    assert all(bool((layer.weight[layer.mask] != 0).all()) for layer in handle.layers)


def test_amp_o2_masks_masters_and_model_weights() -> None:
    torch.manual_seed(0)
    model = _mlp()
    handle = sparsify(model)  # before amp.prepare: the fp32 params become the masters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle.attach(opt)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16))
    for _ in range(3):
        with mp.autocast():
            loss = model(torch.randn(16, 32)).float().square().mean()
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
    for layer in handle.layers:
        assert layer.weight.dtype == torch.bfloat16 and layer.original.dtype == torch.float32
        assert layer.weight is not layer.original
        assert bool((layer.original[~layer.mask] == 0).all()), "fp32 master not masked"
        assert bool((layer.weight[~layer.mask] == 0).all()), "half model weight not masked"
        assert torch.equal(layer.weight, layer.original.to(torch.bfloat16))


def test_amp_o2_attach_after_prepare_order() -> None:
    model = _mlp()
    handle = sparsify(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16))
    handle.attach(opt)  # amp's copy hook now runs first, ours second: both copies still masked
    mp.backward(model(torch.randn(8, 32)).float().sum())
    mp.step()
    for layer in handle.layers:
        assert bool((layer.original[~layer.mask] == 0).all()) and bool((layer.weight[~layer.mask] == 0).all())


def test_sparsify_after_amp_o2_is_refused() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16))
    handle = sparsify(model)
    with pytest.raises(UsageError, match="before amp.prepare"):
        handle.attach(opt)


def test_gradient_accumulation_and_resume() -> None:
    model = _mlp()
    handle = sparsify(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle.attach(opt)
    for _ in range(2):  # two micro-batches, one step
        model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    # resume into a fresh model: sparsify (masks from its random weights), then load: masks come from the file
    model2 = _mlp()
    handle2 = sparsify(model2)
    model2.load_state_dict(state["model"])
    assert all(torch.equal(a.mask, b.mask) for a, b in zip(handle.layers, handle2.layers))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(state["opt"])
    handle2.attach(opt2)
    model2(torch.randn(8, 32)).square().mean().backward()
    opt2.step()
    assert _zero_where_pruned(handle2)


def test_mismatched_masks_at_load_raise() -> None:
    model = _mlp()
    sparsify(model)
    state = model.state_dict()
    state["0.weight"] = torch.randn(64, 32)  # dense weights with the pruned model's masks
    model2 = _mlp()
    sparsify(model2)
    with pytest.raises(UsageError, match="nonzero where its mask prunes"):
        model2.load_state_dict(state)
    state = model.state_dict()
    state["0.weight_sparse_mask"] = torch.ones(64, 32, dtype=torch.bool)
    state["0.weight_sparse_mask"][0, :4] = torch.tensor([True, True, True, False])
    with pytest.raises(UsageError, match="not a 2:4 pattern"):
        _mlp_loaded = _mlp()
        sparsify(_mlp_loaded)
        _mlp_loaded.load_state_dict(state)


def test_two_models_do_not_interfere() -> None:
    a, b = _mlp(), _mlp()
    ha = sparsify(a)
    hb = sparsify(b, Config(mask_calculator="m4n2_2d_best"))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    ha.attach(oa)
    hb.attach(ob)
    b(torch.randn(4, 32)).sum().backward()
    ob.step()
    assert _zero_where_pruned(hb) and _zero_where_pruned(ha)
    assert hb.report().mask_calculator == "m4n2_2d_best"


def test_report_fractions() -> None:
    model = _mlp()
    handle = sparsify(model, Config(disallowed_layer_names=("4",)))
    rep = handle.report(example_inputs=(torch.randn(5, 32),))
    pruned_w = (32 * 64 + 64 * 32) / 2
    total = sum(p.numel() for p in model.parameters())
    assert rep.weight_fraction_pruned == pytest.approx(pruned_w / total)
    macs = 32 * 64 + 64 * 32 + 32 * 10
    assert rep.flop_fraction_pruned == pytest.approx(pruned_w / macs)
    assert 0.5 < rep.retained_magnitude < 1.0
    assert {s["name"]: s["reason"] for s in rep.skipped}["4.weight"] == "in disallowed_layer_names"
    assert "pruned 2:4" in str(rep)


def test_recompute_and_restore() -> None:
    model = _mlp()
    dense = model[0].weight.detach().clone()
    handle = sparsify(model, Config(allow_recompute_mask=True))
    handle.restore_dense()
    assert torch.equal(model[0].weight, dense)
    handle.compute_masks()
    assert is_2to4(model[0].weight)


def _top2_of_4(w: torch.Tensor) -> torch.Tensor:
    """Reference m4n2_1d mask: the 2 largest |w| of every 4 consecutive inputs of a row."""
    g = w.abs().reshape(-1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(2, dim=1).indices, True)
    return keep.reshape(w.shape)


def test_recompute_masks_keeps_trained_weights() -> None:
    """apex semantics: a recompute puts back only the values the old mask removed; weights trained
    since (unpruned) keep their trained values, and restore_dense does the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    dense0 = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = sparsify(model, Config(allow_recompute_mask=True)).attach(opt)
    old_mask = model[0].weight_sparse_mask.clone()
    assert torch.equal(old_mask, _top2_of_4(dense0))
    x, y = torch.randn(64, 16), torch.randn(64, 8)
    for _ in range(20):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    trained = model[0].weight.detach().clone()
    # reference: trained values where the old mask kept, sparsify-time values where it pruned
    dense = torch.where(old_mask, trained, dense0)
    new_mask = _top2_of_4(dense)
    assert not torch.equal(new_mask, old_mask)  # training moved the mask: the recompute matters
    handle.compute_masks()
    assert torch.equal(model[0].weight_sparse_mask, new_mask)
    torch.testing.assert_close(model[0].weight.detach(), dense * new_mask, rtol=0, atol=0)
    handle.restore_dense()
    torch.testing.assert_close(model[0].weight.detach(), dense, rtol=0, atol=0)
    assert bool(model[0].weight_sparse_mask.all())
    with pytest.raises(UsageError, match="allow_recompute_mask=False"):
        sparsify(_mlp()).restore_dense()
    pruned = _mlp()
    sparsify(pruned)  # a copy of a pruned model: its handle never saw the removed values
    with pytest.raises(UsageError, match="reload the dense checkpoint"):
        from_pruned(pruned, Config(allow_recompute_mask=True)).restore_dense()


def test_errors() -> None:
    with pytest.raises(UsageError, match="no prunable layer"):
        sparsify(nn.Sequential(nn.Linear(10, 6), nn.ReLU()))
    model = _mlp()
    sparsify(model)
    with pytest.raises(UsageError, match="already pruned"):
        sparsify(model)
    with pytest.raises(UsageError, match="holds none of the pruned weights"):
        m2 = _mlp()
        sparsify(m2).attach(torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1))
    with pytest.raises(UsageError, match="pattern"):
        Config(pattern="1:4")
    with pytest.raises(UsageError, match="mask_calculator"):
        Config(mask_calculator="m4n3")
    with pytest.raises(UsageError, match=r"SparsityConfig: unknown key\(s\) \[.bogus.\]"):
        Config.from_json('{"bogus": 1}')


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_and_prune(name: str) -> None:
    cfg = PRESETS[name]
    assert Config.from_json(cfg.to_json()) == cfg
    model = _mlp()
    handle = sparsify(model, cfg)
    assert all(is_2to4(layer.weight) for layer in handle.layers)


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


@pytest.mark.parametrize("key", ["disallowed_layer_names", "allowed_layer_names", "layer_types"])
def test_a_bare_string_of_names_is_refused(key: str) -> None:
    # tuple("head") is ('h', 'e', 'a', 'd'): disallowed_layer_names="head" used to prune the head silently
    with pytest.raises(UsageError, match=rf"{key}='head' is a string; pass a tuple.*\('head',\)"):
        Config(**{key: "head"})
    handle = sparsify(_Named(), Config(disallowed_layer_names=["head"]))  # a list is fine
    assert [layer.name for layer in handle.layers] == ["body.weight"]


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adafactor(p, lr=1e-2),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
], ids=["adafactor", "sgd-momentum"])
def test_pruned_gradients_are_zeroed_before_the_step(make_opt) -> None:
    """apex ASP masks gradients before optimizer.step(): optimizers that mix gradients across elements
    (Adafactor's row/column statistics) then update the kept weights as on the pruned model, and no
    state (momentum) builds up in pruned positions. Reference: grads masked by hand, masks applied."""
    torch.manual_seed(0)
    model = _mlp()
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    handle, ref_handle = sparsify(model), sparsify(ref)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    handle.attach(opt)
    x = torch.randn(16, 32)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        for layer in ref_handle.layers:
            layer.weight.grad.mul_(layer.mask)
        ref_opt.step()
        ref_handle.apply_masks()
        ref_opt.zero_grad()
    for layer, ref_layer in zip(handle.layers, ref_handle.layers):
        torch.testing.assert_close(layer.weight, ref_layer.weight, rtol=0, atol=0)
        for state in opt.state[layer.weight].values():
            if torch.is_tensor(state) and state.shape == layer.mask.shape:
                assert bool((state[~layer.mask] == 0).all())


class _TiedLM(nn.Module):
    """An LM head tied to the token embedding (GPT-2, Llama with tie_word_embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.emb(tokens))))


def test_head_tied_to_an_embedding_is_skipped_with_the_reason() -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    table = model.emb.weight.detach().clone()
    handle = sparsify(model)
    assert [layer.name for layer in handle.layers] == ["body.weight"]
    reasons = {s.name: s.skip_reason for s in handle.skipped}
    assert "tied to emb.weight (Embedding)" in reasons["head.weight"]
    torch.testing.assert_close(model.emb.weight.detach(), table, rtol=0, atol=0)  # the table is not pruned
    # named explicitly, it is pruned (and the embedding with it), as asked
    model = _TiedLM()
    handle = sparsify(model, Config(allowed_layer_names=("body", "head")))
    assert {layer.name for layer in handle.layers} == {"body.weight", "head.weight"}
    assert is_2to4(model.emb.weight) and float((model.emb.weight == 0).float().mean()) == 0.5


def test_transposed_layouts_are_reported_skipped_not_passed_over() -> None:
    model = nn.Sequential(nn.ConvTranspose2d(32, 32, 3), nn.Conv2d(32, 32, 3))
    handle = sparsify(model)
    assert [layer.name for layer in handle.layers] == ["1.weight"]
    assert "transposed convolution" in {s.name: s.skip_reason for s in handle.skipped}["0.weight"]
    with pytest.raises(UsageError, match="0.weight: transposed convolution"):
        sparsify(nn.Sequential(nn.ConvTranspose1d(32, 32, 3)))


@pytest.mark.parametrize("calculator", ["m4n2_1d", "m4n2_2d_best"])
def test_gpt2_conv1d_is_pruned_as_the_linear_it_is(tmp_path, calculator: str) -> None:
    """transformers' Conv1D (GPT-2) computes x @ W + b with W stored (in, out); it used to be skipped. It is pruned as
    the Linear with weight W.t(): the mask is the one that Linear gets (groups of 4 along the input dimension, dim 0 of
    W), its outputs equal that pruned Linear's to 1e-6, the FLOP count includes it, and the compressed checkpoint loads
    back exactly."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    from overdrive.sparsity import compute_mask, load_compressed, save_compressed

    torch.manual_seed(0)
    mlp = nn.Sequential(pytorch_utils.Conv1D(64, 32), nn.ReLU(), nn.Linear(64, 32))  # Conv1D(nf=out 64, nx=in 32)
    dense = mlp[0].weight.detach().clone()  # (32 in, 64 out)
    handle = sparsify(mlp, Config(mask_calculator=calculator))
    assert [(layer.name, layer.layer_type) for layer in handle.layers] == [("0.weight", "Conv1D"), ("2.weight", "Linear")]
    w = mlp[0].weight.detach()
    assert is_2to4(w.t())  # groups of 4 along the input dimension (a 2-D mask is 2:4 along both)
    assert calculator != "m4n2_1d" or not is_2to4(w)
    ref_mask = compute_mask(dense.t(), calculator)  # what nn.Linear(32, 64) holding dense.t() gets
    torch.testing.assert_close(w.t(), dense.t() * ref_mask, rtol=0, atol=0)
    x = torch.randn(5, 32)
    torch.testing.assert_close(mlp[0](x), torch.nn.functional.linear(x, dense.t() * ref_mask, mlp[0].bias),
                               rtol=1e-6, atol=1e-6)
    rep = handle.report((x,))
    assert rep.flop_fraction_pruned == pytest.approx(0.5)  # both GEMMs are pruned by half
    stats = save_compressed(handle, tmp_path / "m.sparse24.pt")
    assert stats["compressed_weight_bytes"] < stats["dense_weight_bytes"]
    fresh = nn.Sequential(pytorch_utils.Conv1D(64, 32), nn.ReLU(), nn.Linear(64, 32))
    loaded = load_compressed(fresh, tmp_path / "m.sparse24.pt")
    torch.testing.assert_close(fresh[0].weight, mlp[0].weight, rtol=0, atol=0)
    assert torch.equal(fresh[0].weight_sparse_mask, handle.layers[0].mask) and loaded.layers[0].transposed
    loaded.verify()
    # trained with the handle, the Conv1D keeps its pattern
    opt = torch.optim.SGD(mlp.parameters(), lr=0.5)
    handle.attach(opt)
    mlp(x).sum().backward()
    opt.step()
    assert is_2to4(mlp[0].weight.detach().t())


def test_gpt2_model_prunes_its_attention_and_mlp_layers() -> None:
    """A small GPT-2 from transformers: every Conv1D (c_attn, c_proj, c_fc) is pruned, the tied LM head / embedding
    is not (tied), and the pruned model still runs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    handle = sparsify(model)
    kinds = {layer.name.rsplit(".", 2)[-2] for layer in handle.layers if layer.layer_type == "Conv1D"}
    assert kinds == {"c_attn", "c_proj", "c_fc"} and len(handle.layers) == 2 * 4
    assert all(is_2to4(layer.weight.detach().t()) for layer in handle.layers)
    ids = torch.randint(0, 128, (2, 16))
    assert torch.isfinite(model(ids).logits).all()
    assert handle.report((ids,)).flop_fraction_pruned > 0.3


def test_attach_when_every_pruned_layer_is_frozen() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))  # only layer 0 is prunable
    model[0].requires_grad_(False)
    handle = sparsify(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    handle.attach(opt)  # the head trains; the frozen pruned layer needs no hook
    frozen = model[0].weight.detach().clone()
    for _ in range(2):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(model[0].weight.detach(), frozen, rtol=0, atol=0)
    assert _zero_where_pruned(handle)
    with pytest.raises(UsageError, match="holds none of the pruned weights"):  # a trainable pruned layer still needs it
        handle2 = sparsify(nn.Sequential(nn.Linear(32, 32)))
        handle2.attach(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


@pytest.mark.parametrize("budget", [0, -1.0, float("nan"), "2", True])
def test_permutation_budget_must_be_a_positive_number(budget) -> None:
    # nan passed `budget <= 0` and then switched the search off silently ("2" raised a TypeError)
    with pytest.raises(UsageError, match=r"permutation_budget_s .* must be a number of seconds > 0"):
        Config(permutation=True, permutation_budget_s=budget)
    assert Config(permutation_budget_s=1).permutation_budget_s == 1


def test_a_layer_name_that_is_no_module_is_refused() -> None:
    """``SparsityConfig(disallowed_layer_names=("haed",))`` (a typo) or ``("head.weight",)`` (a parameter name) pruned
    the head the user meant to keep dense, without a word; so did an allowed_layer_names entry that matched nothing."""
    model = nn.Sequential()
    model.add_module("body", nn.Linear(32, 32))
    model.add_module("head", nn.Linear(32, 16))
    for cfg, bad in ((Config(disallowed_layer_names=("haed",)), "'haed'"),
                     (Config(disallowed_layer_names=("head.weight",)), "'head.weight'"),
                     (Config(allowed_layer_names=("body", "hed")), "'hed'")):
        with pytest.raises(UsageError, match=f"names {bad}, which is not a module of Sequential.*did you mean"):
            sparsify(model, cfg)
    assert bool((model.head.weight != 0).all())  # refused before any pruning


def test_a_whole_model_pickled_before_the_hooks_moved_still_loads() -> None:
    """``torch.save(model)`` of a pruned model pickles its state-dict hooks by module path; files written when the
    hooks lived in ``overdrive.sparsity.api`` name them there, and must load (and keep checking masks at load)."""
    import pickle

    model = _mlp()
    sparsify(model)
    # protocol 0 writes each class as text ("c<module>\n<name>\n"): point the hooks at their old module
    blob = pickle.dumps(model, protocol=0).replace(b"coverdrive.sparsity.pruned\n", b"coverdrive.sparsity.api\n")
    assert b"coverdrive.sparsity.api\n_LoadCheck" in blob and b"coverdrive.sparsity.api\n_CheckpointNames" in blob
    loaded = pickle.loads(blob)
    x = torch.randn(3, 32)
    assert torch.equal(loaded(x), model(x))  # tolerance 0: same weights, same masks
    bad = {k: v.clone() for k, v in model.state_dict().items()}
    bad["0.weight"].fill_(1.0)
    with pytest.raises(UsageError, match="nonzero where its mask prunes"):
        loaded.load_state_dict(bad)
