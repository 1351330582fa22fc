# source: apex apex/contrib/sparsity/asp.py docstrings / README: init_model_for_pruning(..., allow_recompute_mask=True) keeps the pruned values so compute_sparse_masks() can be called again later in training (masks recomputed from the dense weights), and ASP.restore_pruned_weights() turns the model back into a dense one; ASP.is_sparsity_enabled() before and after
# library: apex.contrib.sparsity
# group: asp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""Iterative pruning with recomputed masks, then back to dense with restore_pruned_weights()."""
import torch
import torch.nn as nn

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0 while the masks are compared: weights stay put

ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[torch.nn.Linear],
                           allow_recompute_mask=True, allow_permutation=False)
ASP.init_optimizer_for_pruning(optimizer)
dense = [m.weight.detach().clone() for m in (model[0], model[2])]

ASP.compute_sparse_masks()
assert ASP.is_sparsity_enabled()
first_masks = [m.weight.detach().ne(0) for m in (model[0], model[2])]
for w, d in zip((model[0].weight, model[2].weight), dense):
    kept = w.detach() != 0
    # m4n2_1d keeps the 2 largest |w| of every 4: no pruned weight is larger than a kept one in its group
    groups_w, groups_k = d.abs().reshape(-1, 4), kept.reshape(-1, 4)
    assert bool((groups_k.sum(1) == 2).all())
    assert bool((groups_w.masked_fill(groups_k, 0).amax(1) <= groups_w.masked_fill(~groups_k, float("inf")).amin(1)).all())

# recomputing the masks with unchanged weights restores the pruned values first, so it finds the same masks
ASP.compute_sparse_masks()
assert all(torch.equal(m.weight.detach().ne(0), f) for m, f in zip((model[0], model[2]), first_masks))

# train for a while with the masks, then recompute them from the trained (dense) weights
for group in optimizer.param_groups:
    group["lr"] = 0.05
g = torch.Generator().manual_seed(1)
for step in range(10):
    x = torch.randn(16, 64, generator=g).to(device)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
assert all(torch.equal(m.weight.detach().ne(0) | f, f) for m, f in zip((model[0], model[2]), first_masks))
ASP.compute_sparse_masks()
assert bool(((model[0].weight.detach() != 0).reshape(-1, 4).sum(1) <= 2).all())

# back to dense: the stored pruned values return, the kept ones keep what they learned
trained_kept = model[0].weight.detach().clone()
ASP.restore_pruned_weights()
assert not ASP.is_sparsity_enabled()
w = model[0].weight.detach()
assert (w != 0).float().mean().item() > 0.99  # dense again
assert torch.equal(w[trained_kept != 0], trained_kept[trained_kept != 0])
