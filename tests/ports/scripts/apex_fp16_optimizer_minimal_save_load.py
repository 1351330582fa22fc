# source: apex examples/FP16_Optimizer_simple (minimal.py, save_load.py) and the FP16_Optimizer docs: a model made .half(), FP16_Optimizer(optimizer, static_loss_scale=128.0) then dynamic_loss_scale=True with dynamic_loss_args={'scale_window': 500}, optimizer.backward(loss), clip_master_grads, optimizer.loss_scale, checkpoint = {'model', 'optimizer': optimizer.state_dict()} and resume
# library: apex.fp16_utils
# group: amp
# count: extra
# device: written device-agnostic where the examples call .cuda().half() (on the CPU the .half() model is fp16, emulated)
"""FP16_Optimizer's examples: fp32 master weights and loss scaling wrapped around a torch optimizer."""
import torch

# was: from apex.fp16_utils import FP16_Optimizer
from overdrive.apex.fp16_utils import FP16_Optimizer

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
N, D_in, D_out = 64, 64, 8
x = torch.randn(N, D_in, device=device, dtype=torch.float)
y = x[:, :D_out] * 2 - 1


def train(model, optimizer, steps):
    losses = []
    for t in range(steps):
        optimizer.zero_grad()
        y_pred = model(x.half())
        loss = torch.nn.functional.mse_loss(y_pred.float(), y)
        optimizer.backward(loss)  # was loss.backward()
        optimizer.clip_master_grads(5.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


# minimal.py: static loss scale
model = torch.nn.Linear(D_in, D_out).to(device).half()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
optimizer = FP16_Optimizer(optimizer, static_loss_scale=128.0)
losses = train(model, optimizer, 50)
assert losses[-1] < 0.5 * losses[0], losses
assert optimizer.loss_scale == 128.0

# save_load.py: dynamic loss scale, a checkpoint, a rebuilt model and optimizer
model = torch.nn.Sequential(torch.nn.Linear(D_in, 32), torch.nn.ReLU(), torch.nn.Linear(32, D_out)).to(device).half()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 500})
losses = train(model, optimizer, 30)
print("loss scale after 30 steps:", optimizer.loss_scale)
checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
torch.save(checkpoint, "saved.pth")
continued = train(model, optimizer, 10)

model = torch.nn.Sequential(torch.nn.Linear(D_in, 32), torch.nn.ReLU(), torch.nn.Linear(32, D_out)).to(device).half()
optimizer = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                           dynamic_loss_args={"scale_window": 500})
checkpoint = torch.load("saved.pth")
model.load_state_dict(checkpoint["model"])
optimizer.load_state_dict(checkpoint["optimizer"])
resumed = train(model, optimizer, 10)
assert resumed == continued, (resumed, continued)  # the fp32 masters travel in the checkpoint
assert losses[-1] < 0.5 * losses[0], losses
