# source: NVIDIA DeepLearningExamples sparse fine-tuning with apex (amp.initialize(model, optimizer, opt_level="O2") first, then ASP.prune_trained_model(model, optimizer) on the half model, training with amp.scale_loss), apex ASP README's note that ASP works with amp
# library: apex.contrib.sparsity, apex.amp
# group: asp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""2:4 pruning after amp O2: the masks must hold on the half weights and on the fp32 masters the optimizer steps."""
import torch
import torch.nn as nn

# was: from apex import amp
from overdrive.apex import amp
# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"


def is_2to4(w):
    return bool(((w.reshape(-1, 4) != 0).sum(1) <= 2).all())


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2, self.head = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(self.norm(torch.relu(self.fc1(x))))))


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x_all = torch.randn(256, 32, generator=g).to(device)
y_all = torch.sin(x_all[:, :16] * 2)

model = MLP().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
for step in range(40):  # dense training
    i = (step * 32) % 256
    loss = nn.functional.mse_loss(model(x_all[i:i + 32]).float(), y_all[i:i + 32])
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
with torch.no_grad():
    dense_loss = nn.functional.mse_loss(model(x_all).float(), y_all).item()

ASP.prune_trained_model(model, optimizer)
with torch.no_grad():
    pruned_loss = nn.functional.mse_loss(model(x_all).float(), y_all).item()
for step in range(40):  # sparse fine-tuning
    i = (step * 32) % 256
    loss = nn.functional.mse_loss(model(x_all[i:i + 32]).float(), y_all[i:i + 32])
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
with torch.no_grad():
    finetuned_loss = nn.functional.mse_loss(model(x_all).float(), y_all).item()

half = model.fc1.weight.dtype
assert half in (torch.float16, torch.bfloat16)
for layer in (model.fc1, model.fc2, model.head):
    assert is_2to4(layer.weight) and (layer.weight != 0).float().mean().item() == 0.5
masters = [p for p in amp.master_params(optimizer) if p.dim() == 2]
assert len(masters) == 3 and all(p.dtype == torch.float32 and is_2to4(p) for p in masters)
assert finetuned_loss < pruned_loss and pruned_loss > dense_loss, (dense_loss, pruned_loss, finetuned_loss)
