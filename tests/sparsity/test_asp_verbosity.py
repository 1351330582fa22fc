"""ASP's ``verbosity``: the ``[ASP]`` lines apex prints, naming each weight sparsified or skipped, its shape and
dtype, and the sparsity it got (what a user reads to confirm the pruning)."""

from __future__ import annotations

import re

import torch
from torch import nn

from overdrive.apex.contrib.sparsity import ASP


def _model() -> nn.Module:
    # 0: pruned; 2: (10, 32), out not a multiple of 8; 3: (16, 10), in not a multiple of 16
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10), nn.Linear(10, 16))


def _lines(text: str, tag: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"[ASP] {tag}")]


def test_prune_trained_model_prints_enabled_sparsity_and_skipped_layers(capsys) -> None:
    """prune_trained_model runs at apex's verbosity=2: each pruned weight with its sparsity, each skipped one."""
    model = _model()
    ASP.prune_trained_model(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    out = capsys.readouterr().out
    mask = model[0].weight_sparse_mask
    ref = 100.0 - 100.0 * float(mask.sum()) / mask.numel()  # reference: the installed mask itself
    assert ref == 50.0
    assert _lines(out, "Enabled") == [f"[ASP] Enabled {ref:.2f}% sparsity for 0::weight of size=torch.Size([32, 32]) "
                                      "and type=torch.float32"]
    skipped = _lines(out, "Auto skipping")
    assert [re.search(r"pruning (\S+) of size=(torch.Size\(\[\d+, \d+\]\))", ln).groups() for ln in skipped] == [
        ("2::weight", "torch.Size([10, 32])"), ("3::weight", "torch.Size([16, 10])")]
    assert all("out % 8 == 0 and in % 16 == 0" in ln for ln in skipped)
    assert not _lines(out, "Sparsifying")  # debug lines: verbosity 3 only


def test_verbosity_3_lists_every_weight_and_restore_says_dense(capsys) -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    ASP.init_model_for_pruning(model, verbosity=3, allow_recompute_mask=True, disallowed_layer_names=["2"],
                               allow_permutation=False)
    out = capsys.readouterr().out
    assert _lines(out, "Sparsifying") == ["[ASP] Sparsifying 0::weight of size=torch.Size([32, 32]) and "
                                          "type=torch.float32 for sparsity"]
    assert "[ASP] Not sparsifying 0::bias of size=torch.Size([32]) and type=torch.float32" in out
    assert "[ASP] Not sparsifying 2::weight" in out and "(in disallowed_layer_names)" in out
    ASP.compute_sparse_masks(model)
    assert len(_lines(capsys.readouterr().out, "Enabled 50.00% sparsity for 0::weight")) == 1
    ASP.restore_pruned_weights(model)
    assert capsys.readouterr().out.splitlines() == ["[ASP] Disabled sparsity for 0::weight (dense weights restored)"]


def test_verbosity_0_prints_nothing(capsys) -> None:
    model = _model()
    ASP.init_model_for_pruning(model, verbosity=0, allow_permutation=False)
    ASP.compute_sparse_masks(model)
    assert capsys.readouterr().out == ""


def test_half_weights_are_named_with_their_dtype(capsys) -> None:
    model = nn.Sequential(nn.Linear(32, 16)).half()
    ASP.init_model_for_pruning(model, verbosity=3, allow_permutation=False)
    ASP.compute_sparse_masks(model)
    out = capsys.readouterr().out
    assert "Sparsifying 0::weight of size=torch.Size([16, 32]) and type=torch.float16" in out
    assert "Enabled 50.00% sparsity for 0::weight of size=torch.Size([16, 32]) and type=torch.float16" in out
