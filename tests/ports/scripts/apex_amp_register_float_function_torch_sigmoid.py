# source: classifier training scripts on GitHub (`if USE_AMP: amp.register_float_function(torch, 'sigmoid'); classifier, opt = amp.initialize(classifier, opt, opt_level='O1', verbosity=0)`), sigmoid outputs into nn.BCELoss, the apex docs' "register_float_function(module, function_name)" applied to torch
# library: apex.amp
# group: amp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""A sigmoid classifier under O1 with torch.sigmoid registered as a float function, then trained with BCELoss."""
import torch
import torch.nn as nn

# was: from apex import amp
from overdrive.apex import amp

USE_AMP = True
device = "cuda" if torch.cuda.is_available() else "cpu"


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return torch.sigmoid(self.body(x)).squeeze(-1)


def auc(scores, labels):
    pos, neg = scores[labels == 1], scores[labels == 0]
    return (pos.view(-1, 1) > neg.view(1, -1)).float().mean().item()


if __name__ == "__main__":
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).float()
    x, y = x.to(device), y.to(device)

    classifier = Classifier().to(device)
    loss_fn = torch.nn.BCELoss()
    opt = torch.optim.Adam(classifier.parameters(), lr=1e-2)
    if USE_AMP:
        amp.register_float_function(torch, "sigmoid")
        classifier, opt = amp.initialize(classifier, opt, opt_level="O1", verbosity=0)

    classifier.eval()
    with torch.no_grad():
        start_auc = auc(classifier(x).float(), y)
    classifier.train()
    losses = []
    for epoch in range(30):
        opt.zero_grad()
        probs = classifier(x)
        assert probs.dtype == torch.float32  # the registered sigmoid ran in fp32
        loss = loss_fn(probs, y)
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
        opt.step()
        losses.append(loss.item())
    classifier.eval()
    with torch.no_grad():
        end_auc = auc(classifier(x).float(), y)
    assert losses[-1] < 0.5 * losses[0], losses
    assert end_auc > max(start_auc, 0.9), (start_auc, end_auc)
