# source: apex apex/contrib/sparsity/README.md "checkpointing": run 1 prunes (ASP.prune_trained_model) and torch.save's model + optimizer state; run 2, a new process, builds the model, calls ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=False) and ASP.init_optimizer_for_pruning(optimizer), then loads the checkpoint (masks included) and keeps fine-tuning
# library: apex.contrib.sparsity
# group: asp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""Prune-and-save in one process, resume sparse fine-tuning from the checkpoint in another (apex ASP holds one
model per process, so the two runs are two processes: this script starts run 1 as a child of itself)."""
import subprocess
import sys

import torch
import torch.nn as nn

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"


def build():
    return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 16)).to(device)


def batch(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 16, 6, 6, generator=g)
    return x.to(device), x.mean((2, 3)).to(device)  # learn the per-channel means


def train(model, optimizer, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        x, y = batch(i)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run_1(path):
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    train(model, optimizer, 30)  # the dense "pretraining"
    ASP.prune_trained_model(model, optimizer)
    train(model, optimizer, 10, start=30)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-1"]:
        run_1(sys.argv[2])
        sys.exit(0)
    subprocess.run([sys.executable, __file__, "--run-1", "sparse_checkpoint.pt"], check=True)

    # run 2
    torch.manual_seed(1)  # other initial weights: everything that matters comes from the checkpoint
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2,
                               whitelist=[torch.nn.Linear, torch.nn.Conv2d], allow_recompute_mask=False)
    ASP.init_optimizer_for_pruning(optimizer)
    checkpoint = torch.load("sparse_checkpoint.pt")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])

    saved = {k: v for k, v in checkpoint["model"].items() if k.endswith("weight")}
    for name, value in model.state_dict().items():
        if name in saved:
            assert torch.equal(value, saved[name]), name  # the pruned weights came back (tolerance 0)
    before = [w.detach().ne(0) for w in (model[0].weight, model[2].weight, model[6].weight)]
    losses = train(model, optimizer, 15, start=40)
    after = [w.detach().ne(0) for w in (model[0].weight, model[2].weight, model[6].weight)]
    for b, a, w in zip(before, after, (model[0].weight, model[2].weight, model[6].weight)):
        assert b.float().mean().item() == 0.5  # the checkpoint's masks are in force at once
        assert torch.equal(a, b) or bool((a <= b).all()), "a pruned weight came back to life"
    assert ASP.is_sparsity_enabled()
    # the resumed fine-tuning goes on from the checkpoint's loss (near its floor here: the last five steps' mean, not
    # the last step, which the optimizer's noise at a plateau can leave above the first)
    assert sum(losses[-5:]) / 5 < losses[0], losses
