# source: apex docs advanced.rst "Multiple models/optimizers/losses": amp.initialize([model0, model1], [optimizer0, optimizer1], num_losses=2), scale_loss(..., loss_id=i), a loss that reaches both optimizers passed as a list; amp.initialize(enabled=args.amp) for the fp32 run
# library: apex.amp
# group: amp
"""Two models, two optimizers, two losses under one amp.initialize call, as apex's advanced docs lay out."""
import argparse

import torch
import torch.nn as nn

# was: from apex import amp
from overdrive.apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--amp", type=int, default=1)
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--steps", type=int, default=30)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16))
        self.aux = nn.Linear(16, 1)  # an auxiliary head: loss0 trains only the encoder

    def forward(self, x):
        h = self.body(x)
        return h, self.aux(h)


def data(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(12, 3, generator=g)
    x = torch.randn(64, 12, generator=g)
    return x, x @ w, (x @ w).sum(1, keepdim=True)


def main(argv):
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model0, model1 = Encoder(), nn.Sequential(nn.ReLU(), nn.Linear(16, 3))
    optimizer0 = torch.optim.SGD(model0.parameters(), lr=0.005, momentum=0.9)
    optimizer1 = torch.optim.SGD(model1.parameters(), lr=0.005, momentum=0.9)
    [model0, model1], [optimizer0, optimizer1] = amp.initialize(
        [model0, model1], [optimizer0, optimizer1], enabled=bool(args.amp), opt_level=args.opt_level, num_losses=2)
    loss_fn = nn.MSELoss()
    x, y, y_aux = data(1)
    history = []
    for step in range(args.steps):
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        h, aux = model0(x)
        loss0 = loss_fn(aux.float(), y_aux)
        loss1 = loss_fn(model1(h).float(), y)
        with amp.scale_loss(loss0, optimizer0, loss_id=0) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
        with amp.scale_loss(loss1, [optimizer0, optimizer1], loss_id=1) as scaled_loss:
            scaled_loss.backward()
        optimizer0.step()
        optimizer1.step()
        history.append((loss0.item(), loss1.item()))
    return history


if __name__ == "__main__":
    mixed = main([])
    fp32 = main(["--amp", "0"])
    assert all(torch.isfinite(torch.tensor(h)).all() for h in mixed)
    assert mixed[-1][0] < 0.2 * mixed[0][0] and mixed[-1][1] < 0.6 * mixed[0][1], mixed
    # both losses follow the fp32 run to half-precision rounding (bf16: 8 significant bits; 5% after 30 steps)
    torch.testing.assert_close(torch.tensor(mixed[-1]), torch.tensor(fp32[-1]), rtol=5e-2, atol=1e-2)
    assert len(amp._amp_state.loss_scalers) == 2  # one scaler per loss (the enabled=False run adds none)
