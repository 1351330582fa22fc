# source: apex docs amp.rst "Checkpointing": save {'model', 'optimizer', 'amp': amp.state_dict()}, then build model/optimizer again, amp.initialize with the same opt_level, and load all three
# library: apex.amp
# group: amp
"""apex's documented checkpoint round trip at O2 with a dynamic loss scale."""
import torch
import torch.nn as nn

# was: from apex import amp
from overdrive.apex import amp


def build():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g)
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        yield x, x @ w


def train(model, optimizer, data):
    losses = []
    for x, y in data:
        loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


torch.manual_seed(0)
# Initialization
opt_level = "O2"
model, optimizer = build()
model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale="dynamic")

# Train your model
losses = train(model, optimizer, batches(20, seed=1))

# Save checkpoint
checkpoint = {
    "model": model.state_dict(),
    "optimizer": optimizer.state_dict(),
    "amp": amp.state_dict(),
}
torch.save(checkpoint, "amp_checkpoint.pt")
scale_at_save = amp.state_dict()["loss_scaler0"]["loss_scale"]
masters_at_save = [p.detach().clone() for p in amp.master_params(optimizer)]
reference = train(model, optimizer, batches(5, seed=2))  # how the run would have continued

# Restore
torch.manual_seed(123)  # a different init: everything must come from the checkpoint
model, optimizer = build()
model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale="dynamic")
checkpoint = torch.load("amp_checkpoint.pt", weights_only=False)
model.load_state_dict(checkpoint["model"])
optimizer.load_state_dict(checkpoint["optimizer"])
amp.load_state_dict(checkpoint["amp"])
restored_masters = [p.detach().clone() for p in amp.master_params(optimizer)]

# Continue training
resumed = train(model, optimizer, batches(5, seed=2))

assert losses[-1] < 0.5 * losses[0], losses
assert checkpoint["amp"]["loss_scaler0"]["loss_scale"] == scale_at_save == amp._amp_state.loss_scalers[0].loss_scale()
# the fp32 masters come back exactly (tolerance 0), so the restored run continues exactly as the original did
assert all(p.dtype == torch.float32 for p in restored_masters)
assert all(torch.equal(a, b) for a, b in zip(restored_masters, masters_at_save))
assert resumed == reference, (resumed, reference)
