# source: apex apex/contrib/sparsity/README.md "Usage": load a trained model, ASP.prune_trained_model(model, optimizer), then the usual training loop to fine-tune, torch.save(...) of the pruned model
# library: apex.contrib.sparsity
# group: asp
# device: written device-agnostic (device = torch.device("cuda" if available else "cpu")) where the README uses torch.device('cuda')
"""The README's one-call recipe: prune a trained model to 2:4 and fine-tune it with the masks kept."""
import torch
import torch.nn as nn

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TheModelClass(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def is_2to4(w):
    """At most 2 nonzeros in every group of 4 consecutive input weights (the pattern sparse tensor cores use)."""
    return bool(((w.reshape(-1, 4) != 0).sum(1) <= 2).all())


g = torch.Generator().manual_seed(0)
teacher = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 8))
x_train = torch.randn(256, 32, generator=g)
with torch.no_grad():
    y_train = teacher(x_train)


def train(model, optimizer, epochs):
    loss_function = nn.MSELoss()
    for epoch in range(epochs):
        for i in range(0, 256, 32):
            x, y = x_train[i:i + 32].to(device), y_train[i:i + 32].to(device)
            optimizer.zero_grad()
            y_pred = model(x)
            loss = loss_function(y_pred, y)
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        return loss_function(model(x_train.to(device)), y_train.to(device)).item()


if __name__ == "__main__":
    torch.manual_seed(0)
    dense = TheModelClass().to(device)
    dense_loss = train(dense, torch.optim.Adam(dense.parameters(), lr=3e-3), epochs=30)
    torch.save(dense.state_dict(), "pretrained.pt")

    model = TheModelClass()  # Define model structure
    model.load_state_dict(torch.load("pretrained.pt"))  # Load pretrained model
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    ASP.prune_trained_model(model, optimizer)
    with torch.no_grad():
        pruned_loss = nn.MSELoss()(model(x_train.to(device)), y_train.to(device)).item()
    finetuned_loss = train(model, optimizer, epochs=10)
    torch.save(model.state_dict(), "pruned_finetuned.pt")

    for layer in (model.fc1, model.fc2, model.fc3):
        assert is_2to4(layer.weight), layer  # the masks held through every optimizer step
        assert (layer.weight != 0).float().mean().item() == 0.5
    # pruning costs accuracy and fine-tuning wins most of it back
    assert pruned_loss > dense_loss and finetuned_loss < pruned_loss, (dense_loss, pruned_loss, finetuned_loss)
    assert finetuned_loss < dense_loss + 0.5 * (pruned_loss - dense_loss), (dense_loss, pruned_loss, finetuned_loss)
    reloaded = torch.load("pruned_finetuned.pt")
    assert is_2to4(reloaded["fc2.weight"])
