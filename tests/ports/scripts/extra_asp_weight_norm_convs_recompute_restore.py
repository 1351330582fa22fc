# source: apex apex/contrib/sparsity/README.md "Recompute / restore" pattern (ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=True), init_optimizer_for_pruning, compute_sparse_masks, a short fine-tune, restore_pruned_weights) on a conv network whose layers use torch.nn.utils.weight_norm, as NVIDIA DeepLearningExamples' WaveGlow and HiFi-GAN write their convolutions
# library: apex.contrib.sparsity
# group: asp
# count: extra
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""2:4 pruning of a network with weight-normalized convolutions next to plain ones. Pruning, then restoring the
dense weights before any training step, must give back the network the user started from: the channel
permutation ASP runs on the way must not reorder the plain layers against the weight-normalized ones."""
import torch
import torch.nn as nn
from torch.nn.utils import weight_norm

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = weight_norm(nn.Conv2d(16, 64, 3, padding=1))
        self.act1 = nn.LeakyReLU(0.1)
        self.mid = nn.Conv2d(64, 64, 3, padding=1)
        self.act2 = nn.LeakyReLU(0.1)
        self.post = weight_norm(nn.Conv2d(64, 32, 3, padding=1))
        self.head = nn.Conv2d(32, 1, 1)

    def forward(self, x):
        return self.head(self.post(self.act2(self.mid(self.act1(self.pre(x))))))


model = Net().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(4, 16, 12, 12, device=device)
target = torch.randn(4, 1, 12, 12, device=device)
model.eval()
with torch.no_grad():
    dense_out = model(x)

ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2,
                           whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=True)
ASP.init_optimizer_for_pruning(optimizer)
ASP.compute_sparse_masks()
assert ASP.is_sparsity_enabled()
assert (model.mid.weight == 0).float().mean().item() == 0.5

# back to dense before training: the same network as before pruning
ASP.restore_pruned_weights()
assert not ASP.is_sparsity_enabled()
with torch.no_grad():
    restored_out = model(x)
err = (restored_out - dense_out).abs().max().item()
assert err < 1e-5, f"restored network differs from the dense one by {err}"

# prune again and fine-tune: the pruned positions stay zero through Adam's steps
ASP.compute_sparse_masks()
model.train()
for _ in range(5):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    optimizer.step()
w = model.mid.weight.detach()  # (K, C, R, S): groups of 4 along the input channels C
kept_per_group = (w.permute(0, 2, 3, 1).reshape(-1, 4) != 0).sum(1)
assert kept_per_group.max().item() <= 2
print(f"restored max |diff| {err:.2e}, final loss {loss.item():.4f}")
