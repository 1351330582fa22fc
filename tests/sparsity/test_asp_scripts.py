"""apex ASP scripts with only the import changed (issue 20), written as a user's script after apex's
docs (``apex/contrib/sparsity/README.md``) and checked against the native :func:`sparsify` path."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive import amp
from overdrive._utils.errors import UsageError
from overdrive.sparsity import ASP, SparsityConfig, is_2to4, sparsify
from overdrive.sparsity.permutation import search_permutation

BF16 = torch.bfloat16


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for i in range(steps):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_apex_checkpoint_buffer_names_load() -> None:
    # a checkpoint from apex ASP: float masks under "__weight_mma_mask", pruned values "__weight_mma_pruned_p"
    src = _mlp()
    handle = sparsify(src, SparsityConfig(allow_recompute_mask=True))
    dense = {k: v.clone() for k, v in _mlp().state_dict().items()}
    apex_ckpt = {}
    for k, v in src.state_dict().items():
        if k.endswith("weight_sparse_mask"):
            apex_ckpt[k.replace("weight_sparse_mask", "__weight_mma_mask")] = v.float()
        elif k.endswith("_sparse_pruned"):
            apex_ckpt[k.replace("weight_sparse_pruned", "__weight_mma_pruned_p")] = v
        else:
            apex_ckpt[k] = v
    assert "0.__weight_mma_pruned_p" in apex_ckpt and handle.layers[0].pruned is not None

    model = _mlp(seed=1)
    ASP.init_model_for_pruning(model, verbosity=0, allow_recompute_mask=True, allow_permutation=False)
    ASP.init_optimizer_for_pruning(torch.optim.SGD(model.parameters(), lr=0.1))
    model.load_state_dict(apex_ckpt)  # strict: every apex key is understood
    assert is_2to4(model[0].weight) and ASP.is_sparsity_enabled(model)
    x = torch.randn(3, 32)
    assert torch.equal(model(x), src(x))  # tolerance 0
    ASP.restore_pruned_weights(model)  # the pruned values came from the checkpoint
    assert torch.equal(model[0].weight, dense["0.weight"])


def test_restore_pruned_weights_after_a_resume() -> None:
    model = _mlp()
    dense = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the kept weights stay, so restore is exact
    ASP.init_model_for_pruning(model, verbosity=0, allow_recompute_mask=True, allow_permutation=False)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks(model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    # the resumed run: a fresh process builds the model and ASP the same way, then loads
    resumed = _mlp(seed=5)
    ASP.init_model_for_pruning(resumed, verbosity=0, allow_recompute_mask=True, allow_permutation=False)
    ASP.init_optimizer_for_pruning(torch.optim.SGD(resumed.parameters(), lr=0.0))
    resumed.load_state_dict(torch.load(buf))
    ASP.restore_pruned_weights(resumed)
    assert torch.equal(resumed[0].weight, dense)  # tolerance 0
    assert not ASP.is_sparsity_enabled(resumed)


def test_already_init_without_arguments_and_permutation_saving_params() -> None:
    model = _mlp()
    ASP.set_permutation_saving_params(allow_permutation=True, save_permutation_graph=False,
                                      permutation_output_dir="/tmp")
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    assert ASP.already_init_asp_model() and ASP.already_init_asp_model(model)


def test_callable_mask_calculator_matches_the_named_one() -> None:
    def keep_two_largest(w: torch.Tensor) -> torch.Tensor:  # apex's own m4n2_1d, written by a user
        groups = w.abs().reshape(-1, 4)
        mask = torch.zeros_like(groups, dtype=torch.bool)
        mask.scatter_(1, groups.topk(2, dim=1).indices, True)
        return mask.reshape(w.shape)

    a, b = _mlp(), _mlp()
    ASP.init_model_for_pruning(a, mask_calculator=keep_two_largest, verbosity=0, allow_permutation=False)
    ASP.init_optimizer_for_pruning(torch.optim.SGD(a.parameters(), lr=0.1))
    ASP.compute_sparse_masks(a)
    sparsify(b, SparsityConfig(mask_calculator="m4n2_1d"))
    for la, lb in zip((a[0], a[2]), (b[0], b[2])):
        assert torch.equal(la.weight_sparse_mask, lb.weight_sparse_mask) and torch.equal(la.weight, lb.weight)
    bad = _mlp()
    ASP.init_model_for_pruning(bad, mask_calculator=lambda w: torch.ones(3), verbosity=0, allow_permutation=False)
    with pytest.raises(UsageError, match="mask_calculator returned Tensor of shape"):
        ASP.compute_sparse_masks(bad)
    # a mask of another pattern (half the weights by magnitude, unstructured): accepted before, and its checkpoint
    # was then refused at load as "corrupt"; now refused when computed
    half = _mlp()
    ASP.init_model_for_pruning(half, mask_calculator=lambda w: w.abs() >= w.abs().median(), verbosity=0,
                               allow_permutation=False)
    with pytest.raises(UsageError, match=r"keeps more than 2 of some group of 4 along the input dimension"):
        ASP.compute_sparse_masks(half)


def test_prune_trained_model_after_o2_initialize_matches_pruning_before() -> None:
    def run(prune_first: bool) -> nn.Module:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if prune_first:
            ASP.prune_trained_model(model, opt)
        model, opt = amp.initialize(model, opt, opt_level="O2", dtype=BF16)
        if not prune_first:
            ASP.prune_trained_model(model, opt)
        for i in range(3):
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
            with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        for master in amp.master_params(opt):
            if master.dim() == 2:
                assert is_2to4(master)  # the fp32 masters keep the pattern, not only the half weights
        return model

    after, before = run(False), run(True)
    assert is_2to4(after[0].weight) and is_2to4(after[2].weight)
    # after O2 the masks and permutation are chosen from the bf16 weights, before it from fp32: near-ties may
    # go the other way, so the masks agree on >= 97% of positions and the outputs within bf16 rounding
    for a, b in ((after[0], before[0]), (after[2], before[2])):
        assert (a.weight_sparse_mask == b.weight_sparse_mask).float().mean() >= 0.97
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(after(x), before(x), rtol=0.1, atol=5e-2)  # a flipped near-tie moves one output ~3e-2


def test_permutation_search_is_deterministic() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    perms = [search_permutation(w, budget_s=0.05) for _ in range(3)]
    assert all(torch.equal(p, perms[0]) for p in perms)  # a work budget, not a clock: same result every run
    model_a, model_b = _mlp(), _mlp()
    sparsify(model_a, SparsityConfig(permutation=True))
    sparsify(model_b, SparsityConfig(permutation=True))
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)


class _TwoHeads(nn.Module):
    """One trunk layer feeding a pruned head and a wide dense head (one permutation group)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.head_a, self.head_b = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.head_a(h).sum(-1) + self.head_b(h).sum(-1)


def test_recomputing_masks_after_a_resume_with_the_default_permutation_keeps_the_weights() -> None:
    # the checkpointing script of apex's tests: part 1 prunes and saves; part 2 initializes a fresh model with ASP's
    # defaults (allow_permutation=True), loads, and recomputes the masks. The permutation ran at that first recompute
    # on the already-pruned weights: their columns moved, the masks and the values kept aside did not, so the
    # recompute put the pruned values back in the wrong places (outputs off by units; restore_pruned_weights too)
    kw = dict(verbosity=0, whitelist=[nn.Linear], allow_recompute_mask=True, disallowed_layer_names=["head_b"])
    torch.manual_seed(0)
    part1 = _TwoHeads()
    opt = torch.optim.Adam(part1.parameters(), lr=1e-2)
    ASP.init_model_for_pruning(part1, "m4n2_1d", allow_permutation=False, **kw)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks(part1)
    for i in range(3):
        part1(torch.randn(8, 32, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(part1.state_dict(), buf)
    buf.seek(0)

    part2 = _TwoHeads()
    ASP.init_model_for_pruning(part2, "m4n2_1d", **kw)
    ASP.init_optimizer_for_pruning(torch.optim.Adam(part2.parameters(), lr=1e-2))
    part2.load_state_dict(torch.load(buf))
    ASP.compute_sparse_masks(part1)
    ASP.compute_sparse_masks(part2)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(part2(x), part1(x), rtol=0, atol=1e-6)
    assert torch.equal(part2.head_a.weight_sparse_mask, part1.head_a.weight_sparse_mask)
    assert ASP.handle(part2).permutation["groups"] == 0
    ASP.restore_pruned_weights(part1)
    ASP.restore_pruned_weights(part2)
    torch.testing.assert_close(part2(x), part1(x), rtol=0, atol=1e-6)
