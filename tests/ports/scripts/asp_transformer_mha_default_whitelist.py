# source: apex ASP's default whitelist of init_model_for_pruning [Linear, Conv1d, Conv2d, Conv3d, MultiheadAttention] on a torch.nn.TransformerEncoder (the MultiheadAttention in_proj_weight, out_proj and the feed-forward Linears all pruned): ASP.init_model_for_pruning(model), ASP.init_optimizer_for_pruning(optimizer), ASP.compute_sparse_masks() (prune_trained_model passes whitelist=[Linear, Conv2d], which leaves in_proj_weight dense), fine-tune, then evaluate under torch.no_grad() in eval mode
# library: apex.contrib.sparsity
# group: asp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""Prune a small nn.TransformerEncoder classifier with the default whitelist, fine-tune, evaluate."""
import torch
import torch.nn as nn

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"


class Classifier(nn.Module):
    def __init__(self, vocab=32, d_model=32, num_classes=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


def is_2to4(w):
    return bool(((w.reshape(-1, 4) != 0).sum(1) <= 2).all()) and (w != 0).float().mean().item() == 0.5


def accuracy(model, ids, labels):
    model.eval()
    with torch.no_grad():
        acc = (model(ids).argmax(-1) == labels).float().mean().item()
    model.train()
    return acc


if __name__ == "__main__":
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (128, 10), generator=g).to(device)
    labels = (ids == 3).sum(1).clamp(max=7).to(device)  # count the 3s

    model = Classifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(60):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(ids), labels).backward()
        optimizer.step()
    dense_acc = accuracy(model, ids, labels)

    ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, allow_recompute_mask=False)
    ASP.init_optimizer_for_pruning(optimizer)
    ASP.compute_sparse_masks()
    pruned_acc = accuracy(model, ids, labels)
    for step in range(40):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(ids), labels).backward()
        optimizer.step()
    finetuned_acc = accuracy(model, ids, labels)

    for i, layer in enumerate(model.encoder.layers):
        for name, w in (("self_attn.in_proj_weight", layer.self_attn.in_proj_weight),
                        ("self_attn.out_proj.weight", layer.self_attn.out_proj.weight),
                        ("linear1.weight", layer.linear1.weight), ("linear2.weight", layer.linear2.weight)):
            assert is_2to4(w.detach()), f"encoder.layers.{i}.{name}"
    assert is_2to4(model.head.weight.detach())
    assert dense_acc > 0.8 and finetuned_acc >= pruned_acc and finetuned_acc > 0.8, (dense_acc, pruned_acc,
                                                                                         finetuned_acc)
