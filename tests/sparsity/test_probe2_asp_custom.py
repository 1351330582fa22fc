"""apex's ASP face: custom_layer_dict prunes other layer types' named parameters (it was refused), and create_mask
takes a 1-D tensor as one row (it was refused); reference: the m4n2_1d rule (the 2 largest |w| of each 4 kept)."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn

from overdrive.apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity.sparse_masklib import create_mask


class Scaled(nn.Module):  # not a Linear subclass: its own weight, used in a matmul
    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel.t()


def _m4n2(w: torch.Tensor) -> torch.Tensor:
    g = w.reshape(-1, 4).abs()
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(2, dim=1).indices, True)
    return keep.reshape(w.shape)


def test_custom_layer_dict_prunes_the_named_parameters() -> None:
    gc.collect()  # models of earlier tests, held in cycles, leave ASP's weak registry: the model-less calls need one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), Scaled())
    before = model[1].kernel.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=0, custom_layer_dict={Scaled: ["kernel"]},
                               allow_permutation=False)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    kept = model[1].kernel.detach() != 0
    assert torch.equal(kept, _m4n2(before))
    assert (model[0].weight == 0).float().mean() == 0.5  # the Linear is pruned too


def test_create_mask_takes_a_vector_as_one_row() -> None:
    torch.manual_seed(0)
    v = torch.randn(16)
    mask = create_mask(v, "m4n2_1d")
    assert mask.shape == v.shape and torch.equal(mask.bool(), _m4n2(v))
