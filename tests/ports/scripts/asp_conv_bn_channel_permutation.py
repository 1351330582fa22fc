# source: apex apex/contrib/sparsity/README.md "Channel Permutation": ASP.set_permutation_saving_params(allow_permutation=True, save_permutation_graph=False, permutation_output_dir=...) then ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=True, allow_permutation=True), init_optimizer_for_pruning, compute_sparse_masks() on a conv + BatchNorm network; restore_pruned_weights() at the end
# library: apex.contrib.sparsity
# group: asp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""2:4 pruning of a small conv/BN network with channel permutation: it should keep at least as much weight magnitude
as pruning in the original channel order, and the permutation itself must not change what the network computes."""
import copy

import torch
import torch.nn as nn

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"


def block(c_in, c_out):
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


def prune_in_original_order(w):
    """Plain m4n2_1d on w (K, C, R, S) or (K, C): keep the 2 largest |w| of each 4 along C."""
    w4 = w if w.dim() == 4 else w[:, :, None, None]
    groups = w4.abs().permute(0, 2, 3, 1).reshape(-1, 4)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(2, dim=1).indices, True)
    mask = mask.reshape(w4.shape[0], w4.shape[2], w4.shape[3], w4.shape[1]).permute(0, 3, 1, 2)
    return w * mask.reshape(w.shape)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = nn.Sequential(*block(16, 32), *block(32, 32), *block(32, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 16)).to(device)
    with torch.no_grad():  # a "trained" look: some input channels matter much more than others
        for m in model:
            if isinstance(m, nn.Conv2d):
                m.weight.mul_(torch.rand(1, m.weight.shape[1], 1, 1) * 3)
    model.eval()
    x = torch.randn(8, 16, 8, 8, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        dense_out = model(x)
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for m in plain.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.copy_(prune_in_original_order(m.weight))
        plain_out = plain(x)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ASP.set_permutation_saving_params(allow_permutation=True, save_permutation_graph=False,
                                      permutation_output_dir=".")
    ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2,
                               whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=True,
                               allow_permutation=True)
    ASP.init_optimizer_for_pruning(optimizer)
    ASP.compute_sparse_masks()

    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    plain_layers = [m for m in plain.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    for m in layers:
        w = m.weight.detach()
        w4 = w if w.dim() == 4 else w[:, :, None, None]
        assert bool(((w4.permute(2, 3, 0, 1).reshape(-1, w4.shape[1] // 4, 4) != 0).sum(-1) <= 2).all()), m
    # channel permutation only reorders channels (the total magnitude is unchanged), and what is kept is at least
    # what pruning in the original order keeps
    kept = sum(m.weight.detach().abs().sum().item() for m in layers)
    kept_plain = sum(m.weight.detach().abs().sum().item() for m in plain_layers)
    assert kept >= kept_plain * (1 - 1e-6), (kept, kept_plain)
    with torch.no_grad():
        sparse_out = model(x)
    err = ((sparse_out - dense_out).norm() / dense_out.norm()).item()
    err_plain = ((plain_out - dense_out).norm() / dense_out.norm()).item()
    assert err < err_plain, (err, err_plain)
    assert ASP.is_sparsity_enabled()
    # back to dense: the permuted network computes what the original did (fp32 reordering only, rtol 1e-4)
    ASP.restore_pruned_weights()
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense_out, rtol=1e-4, atol=1e-5)
