# source: apex docs advanced.rst "Gradient accumulation across iterations": scale_loss(loss, optimizer, delay_unscale=True) on the accumulating iterations, a plain scale_loss + optimizer.step() + zero_grad() every iters_to_accumulate; with apex.optimizers.FusedAdam at O2
# library: apex.amp, apex.optimizers
# group: amp
"""Gradient accumulation with delay_unscale under O2, checked against one fp32 step over the whole batch."""
import copy

import torch
import torch.nn as nn

# was: from apex import amp
from overdrive.apex import amp
# was: from apex.optimizers import FusedAdam
from overdrive.apex.optimizers import FusedAdam

iters_to_accumulate = 4

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 8))
reference = copy.deepcopy(model)  # an fp32 copy for the check at the end
optimizer = FusedAdam(model.parameters(), lr=2e-2, weight_decay=0.01)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic")

g = torch.Generator().manual_seed(1)
w = torch.randn(16, 8, generator=g)
data = [torch.randn(8, 16, generator=g) for _ in range(iters_to_accumulate)] * 8  # 8 passes over one batch
first_window_grads = None
losses = []
for iter, input in enumerate(data, start=1):
    target = torch.tanh(input @ w)
    loss = nn.functional.mse_loss(model(input).float(), target) / iters_to_accumulate
    if iter % iters_to_accumulate == 0:
        # Every iters_to_accumulate iterations, unscale and step
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if first_window_grads is None:
            first_window_grads = [p.grad.detach().clone() for p in amp.master_params(optimizer)]
        optimizer.step()
        optimizer.zero_grad()
    else:
        # Otherwise, accumulate gradients, don't unscale or step.
        with amp.scale_loss(loss, optimizer, delay_unscale=True) as scaled_loss:
            scaled_loss.backward()
    losses.append(loss.item() * iters_to_accumulate)

# the accumulated, unscaled master gradients of the first window are the fp32 gradient of the whole batch,
# to half-precision rounding (relative error of the flattened gradient < 3e-2; a missing or double unscale
# would be off by the loss scale, 2**16)
batch = torch.cat(data[:iters_to_accumulate])
nn.functional.mse_loss(reference(batch), torch.tanh(batch @ w)).backward()
ref = torch.cat([p.grad.flatten() for p in reference.parameters()])
got = torch.cat([q.flatten() for q in first_window_grads])
assert ((got - ref).norm() / ref.norm()).item() < 3e-2, ((got - ref).norm() / ref.norm()).item()
assert sum(losses[-4:]) < 0.7 * sum(losses[:4]), losses
assert type(optimizer).__name__ in ("AdamW", "FusedAdam")
