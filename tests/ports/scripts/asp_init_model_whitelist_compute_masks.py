# source: apex apex/contrib/sparsity/README.md, the explicit form: ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=False), ASP.init_optimizer_for_pruning(optimizer), ASP.compute_sparse_masks() with no arguments, ASP.is_sparsity_enabled()
# library: apex.contrib.sparsity
# group: asp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""The three-step ASP flow on a small conv net, with apex's no-argument classmethod calls."""
import torch
import torch.nn as nn
import torch.nn.functional as F

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def conv_is_2to4(w):
    """apex prunes convolutions along the input channels: groups of 4 in C of each (K, R, S)."""
    k, c, r, s = w.shape
    return bool(((w.permute(2, 3, 0, 1).reshape(-1, c // 4, 4) != 0).sum(-1) <= 2).all())


def data(n=128):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 4
    x = torch.randn(n, 4, 8, 8, generator=g) * 0.5
    x[torch.arange(n), y] += 1.0  # the bright channel is the class
    return x.to(device), y.to(device)


def train(model, optimizer, steps):
    x, y = data()
    for step in range(steps):
        i = (step * 32) % 128
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dense_acc = train(model, optimizer, steps=30)

    ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2,
                               whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=False)
    ASP.init_optimizer_for_pruning(optimizer)
    assert not ASP.is_sparsity_enabled()  # masks are all ones until they are computed
    ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()
    sparse_acc = train(model, optimizer, steps=20)

    w = model.conv2.weight
    assert conv_is_2to4(w) and (w != 0).float().mean().item() == 0.5
    w = model.fc1.weight
    assert bool(((w.reshape(-1, 4) != 0).sum(1) <= 2).all()) and (w != 0).float().mean().item() == 0.5
    # apex auto-skips weights whose shape sparse GEMMs cannot use (out % 8 or in % 16): conv1 (C=4), fc2 (out=4)
    assert bool((model.conv1.weight != 0).all()) and bool((model.fc2.weight != 0).all())
    assert dense_acc > 0.9 and sparse_acc > 0.9, (dense_acc, sparse_acc)
