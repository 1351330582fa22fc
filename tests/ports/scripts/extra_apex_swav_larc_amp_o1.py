# source: facebookresearch/swav main_swav.py (SimCLR/MoCo-style repos wrap SGD the same way): import apex, from apex.parallel.LARC import LARC, LARC(optimizer=SGD(momentum, weight_decay), trust_coefficient=0.001, clip=False), apex.amp.initialize(model, optimizer, opt_level="O1"), warmup + cosine lr written into optimizer.param_groups, prototypes normalized under no_grad and their grads set to None while frozen, apex.amp.scale_loss, checkpoint with optimizer.state_dict() and apex.amp.state_dict(), resume
# library: apex.parallel (LARC), apex.amp
# group: amp
# count: extra
# device: written device-agnostic where main_swav.py calls .cuda(); SyncBatchNorm (convert_syncbn_model over a process group) left out, as in a single-GPU run
"""SwAV's training step: SGD wrapped in LARC, amp O1, Sinkhorn-Knopp codes, a frozen-then-trained prototype layer."""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# was: import apex
import overdrive.apex as apex
# was: from apex.parallel.LARC import LARC
from overdrive.apex.parallel.LARC import LARC

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(31)


class Args:
    base_lr, final_lr, wd, warmup_epochs, start_warmup, epochs = 0.6, 0.0006, 1e-6, 1, 0.0, 3
    nmb_prototypes, feat_dim, temperature, epsilon, sinkhorn_iterations = 16, 8, 0.1, 0.05, 3
    freeze_prototypes_niters, crops_for_assign, nmb_crops, use_fp16 = 2, [0, 1], [2], True


args = Args()


class ResNetSmall(nn.Module):
    def __init__(self, output_dim, nmb_prototypes):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projection_head = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                             nn.Linear(16, output_dim))
        self.prototypes = nn.Linear(output_dim, nmb_prototypes, bias=False)

    def forward(self, inputs):
        x = self.projection_head(torch.cat([self.body(v) for v in inputs]))
        x = nn.functional.normalize(x, dim=1, p=2)
        return x, self.prototypes(x)


@torch.no_grad()
def distributed_sinkhorn(out):
    Q = torch.exp(out / args.epsilon).t()  # Q is K-by-B
    B, K = Q.shape[1], Q.shape[0]
    Q /= torch.sum(Q)
    for _ in range(args.sinkhorn_iterations):
        Q /= torch.sum(Q, dim=1, keepdim=True)
        Q /= K
        Q /= torch.sum(Q, dim=0, keepdim=True)
        Q /= B
    Q *= B
    return Q.t()


def loaders(n_iters, bs=8):
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(bs, 3, 8, 8, generator=g) for _ in range(sum(args.nmb_crops))] for _ in range(n_iters)]


model = ResNetSmall(args.feat_dim, args.nmb_prototypes).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=0.9, weight_decay=args.wd)
optimizer = LARC(optimizer=optimizer, trust_coefficient=0.001, clip=False)

train_loader = loaders(4)
warmup_lr_schedule = np.linspace(args.start_warmup, args.base_lr, len(train_loader) * args.warmup_epochs)
iters = np.arange(len(train_loader) * (args.epochs - args.warmup_epochs))
cosine_lr_schedule = np.array([args.final_lr + 0.5 * (args.base_lr - args.final_lr) * (1 + math.cos(
    math.pi * t / (len(train_loader) * (args.epochs - args.warmup_epochs)))) for t in iters])
lr_schedule = np.concatenate((warmup_lr_schedule, cosine_lr_schedule))

if args.use_fp16:
    model, optimizer = apex.amp.initialize(model, optimizer, opt_level="O1")


def train(train_loader, model, optimizer, epoch, lr_schedule):
    model.train()
    losses = []
    for it, inputs in enumerate(train_loader):
        iteration = epoch * len(train_loader) + it
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_schedule[iteration]

        # normalize the prototypes
        with torch.no_grad():
            w = model.prototypes.weight.data.clone()
            w = nn.functional.normalize(w, dim=1, p=2)
            model.prototypes.weight.copy_(w)

        embedding, output = model([x.to(device, non_blocking=True) for x in inputs])
        embedding = embedding.detach()
        bs = inputs[0].size(0)

        loss = 0
        for i, crop_id in enumerate(args.crops_for_assign):
            with torch.no_grad():
                out = output[bs * crop_id: bs * (crop_id + 1)].detach()
                q = distributed_sinkhorn(out.float())[-bs:]
            subloss = 0
            for v in np.delete(np.arange(np.sum(args.nmb_crops)), crop_id):
                x = output[bs * v: bs * (v + 1)] / args.temperature
                subloss -= torch.mean(torch.sum(q * F.log_softmax(x, dim=1), dim=1))
            loss += subloss / (np.sum(args.nmb_crops) - 1)
        loss /= len(args.crops_for_assign)

        optimizer.zero_grad()
        if args.use_fp16:
            with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        # cancel gradients for the prototypes
        if iteration < args.freeze_prototypes_niters:
            for name, p in model.named_parameters():
                if "prototypes" in name:
                    p.grad = None
        optimizer.step()
        losses.append(loss.item())
    return losses


start_proto = model.prototypes.weight.detach().clone()
start_conv = model.body[0].weight.detach().clone()
losses = train(train_loader, model, optimizer, 0, lr_schedule)
assert all(math.isfinite(v) for v in losses), losses
assert not torch.equal(model.body[0].weight.detach(), start_conv), "LARC + SGD did not move the weights"
assert optimizer.param_groups[0]["weight_decay"] == args.wd, "LARC hands the weight decay back after each step"
assert optimizer.param_groups[0]["lr"] == lr_schedule[len(train_loader) - 1]
# the first iterations left the prototypes alone (only normalized), later ones trained them
assert not torch.equal(model.prototypes.weight.detach(), nn.functional.normalize(start_proto, dim=1, p=2))

save_dict = {"epoch": 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}
if args.use_fp16:
    save_dict["amp"] = apex.amp.state_dict()
torch.save(save_dict, "checkpoint.pth.tar")

# restart_from_checkpoint: a fresh model and optimizer, as after a preemption
del model, optimizer
model2 = ResNetSmall(args.feat_dim, args.nmb_prototypes).to(device)
optimizer2 = LARC(optimizer=torch.optim.SGD(model2.parameters(), lr=args.base_lr, momentum=0.9,
                                            weight_decay=args.wd), trust_coefficient=0.001, clip=False)
model2, optimizer2 = apex.amp.initialize(model2, optimizer2, opt_level="O1")
# weights_only=False: the lr written from the numpy schedule is a numpy scalar, which torch >= 2.6 loads only so
# (the same with apex)
checkpoint = torch.load("checkpoint.pth.tar", map_location="cpu", weights_only=False)
model2.load_state_dict(checkpoint["state_dict"])
optimizer2.load_state_dict(checkpoint["optimizer"])
apex.amp.load_state_dict(checkpoint["amp"])
assert len(optimizer2.state) == len(list(model2.parameters()))
assert all("momentum_buffer" in s for s in optimizer2.state.values())
losses2 = train(train_loader, model2, optimizer2, checkpoint["epoch"], lr_schedule)
assert all(math.isfinite(v) for v in losses2), losses2
print(f"swav LARC + O1: loss {losses[0]:.4f} -> {losses2[-1]:.4f}")
