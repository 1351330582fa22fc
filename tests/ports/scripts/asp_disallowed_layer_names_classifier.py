# source: apex ASP init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[torch.nn.Linear], allowed_layer_names=None, disallowed_layer_names=[...]) as BERT fine-tuning recipes use it, keeping the pooler and the task head dense; then init_optimizer_for_pruning, compute_sparse_masks(), fine-tune
# library: apex.contrib.sparsity
# group: asp
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""Prune a BERT-like encoder's Linear layers to 2:4 but keep the layers named in disallowed_layer_names dense."""
import torch
import torch.nn as nn

# was: from apex.contrib.sparsity import ASP
from overdrive.apex.contrib.sparsity import ASP

device = "cuda" if torch.cuda.is_available() else "cpu"


class Layer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.attention = nn.ModuleDict({"query": nn.Linear(hidden, hidden), "key": nn.Linear(hidden, hidden),
                                        "value": nn.Linear(hidden, hidden), "output": nn.Linear(hidden, hidden)})
        self.intermediate = nn.Linear(hidden, 2 * hidden)
        self.output = nn.Linear(2 * hidden, hidden)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

    def forward(self, h):
        a = self.attention
        scores = a["query"](h) @ a["key"](h).transpose(1, 2) / h.size(-1) ** 0.5
        h = self.norm1(h + a["output"](scores.softmax(-1) @ a["value"](h)))
        return self.norm2(h + self.output(torch.nn.functional.gelu(self.intermediate(h))))


class BertForSequenceClassification(nn.Module):
    def __init__(self, vocab=64, hidden=32, num_labels=16):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden)
        self.encoder = nn.ModuleList([Layer(hidden), Layer(hidden)])
        self.pooler = nn.ModuleDict({"dense": nn.Linear(hidden, hidden)})
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, input_ids):
        h = self.embeddings(input_ids)
        for layer in self.encoder:
            h = layer(h)
        return self.classifier(torch.tanh(self.pooler["dense"](h[:, 0])))


def is_2to4(w):
    return bool(((w.reshape(-1, 4) != 0).sum(1) <= 2).all())


if __name__ == "__main__":
    torch.manual_seed(0)
    model = BertForSequenceClassification().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2, whitelist=[torch.nn.Linear],
                               allowed_layer_names=None, disallowed_layer_names=["pooler.dense", "classifier"],
                               allow_recompute_mask=False)
    ASP.init_optimizer_for_pruning(optimizer)
    ASP.compute_sparse_masks()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (64, 8), generator=g).to(device)
    labels = (ids[:, 0] % 16).to(device)  # the first token's id decides the label
    losses = []
    for step in range(40):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(ids), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    pruned = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and (m.weight == 0).any()}
    assert pruned == {f"encoder.{i}.{n}" for i in range(2) for n in
                      ("attention.query", "attention.key", "attention.value", "attention.output", "intermediate",
                       "output")}, sorted(pruned)
    for n in pruned:
        assert is_2to4(model.get_submodule(n).weight), n
    assert bool((model.classifier.weight != 0).all()) and bool((model.pooler["dense"].weight != 0).all())
    assert losses[-1] < 0.3 * losses[0], losses
