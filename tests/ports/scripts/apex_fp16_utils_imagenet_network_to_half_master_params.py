# source: apex examples/imagenet main.py before amp (--fp16 --static-loss-scale): network_to_half(model), prep_param_lists(model), SGD on master_params, loss * static_loss_scale, model.zero_grad(), model_grads_to_master_grads, master grads * 1/loss_scale, master_params_to_model_params, to_python_float for the meters
# library: apex.fp16_utils
# group: amp
# count: extra
# device: written device-agnostic where main.py calls .cuda(); network_to_half gives the device's half dtype (bfloat16 on the CPU, as overdrive.amp)
"""apex's manual mixed-precision recipe: a half network with fp32 BatchNorm, fp32 master copies stepped by SGD."""
import argparse

import torch
import torch.nn as nn

# was: from apex.fp16_utils import network_to_half, prep_param_lists, model_grads_to_master_grads, master_params_to_model_params, to_python_float
from overdrive.apex.fp16_utils import network_to_half, prep_param_lists, model_grads_to_master_grads, master_params_to_model_params, to_python_float

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--fp16", action="store_true", default=True)
parser.add_argument("--static-loss-scale", type=float, default=128.0)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    nn.Linear(32, 4),
).to(device)
if args.fp16:
    model = network_to_half(model)
param_copy = model.parameters()
if args.fp16:
    model_params, master_params = prep_param_lists(model)
    param_copy = master_params
criterion = nn.CrossEntropyLoss().to(device)
optimizer = torch.optim.SGD(param_copy, args.lr, momentum=0.9, weight_decay=1e-4)

g = torch.Generator().manual_seed(1)
images = torch.randn(64, 3, 16, 16, generator=g)
target = torch.arange(64) % 4
images[torch.arange(64), target % 3] += 2.0  # a learnable signal in the channel means
images, target = images.to(device), target.to(device)
losses = []
for epoch in range(12):
    for i in range(0, 64, 16):
        output = model(images[i:i + 16])
        loss = criterion(output.float(), target[i:i + 16])
        losses.append(to_python_float(loss.data))
        if args.fp16:
            loss = loss * args.static_loss_scale
            model.zero_grad()
            loss.backward()
            model_grads_to_master_grads(model_params, master_params)
            for param in master_params:
                param.grad.data.mul_(1. / args.static_loss_scale)
            optimizer.step()
            master_params_to_model_params(model_params, master_params)
        else:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
half = model[1][0].weight.dtype
assert half in (torch.float16, torch.bfloat16) and model[1][1].weight.dtype == torch.float32
assert all(m.dtype == torch.float32 for m in master_params)
assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses
