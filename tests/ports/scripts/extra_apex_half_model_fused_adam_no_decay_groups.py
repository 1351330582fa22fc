# source: DeepLearningExamples BERT fine-tuning (run_squad.py / run_glue.py: no_decay = ['bias', 'gamma', 'beta', 'LayerNorm'] param groups, FusedAdam(optimizer_grouped_parameters, lr=..., bias_correction=False)) run as fairseq's --memory-efficient-fp16 runs it (model.half(), the optimizer stepping the fp16 weights, a static loss scale unscaled by hand, clip_grad_norm_), apex.normalization.FusedLayerNorm in the encoder; then DLE BERT pretraining's FusedLAMB over a half model, checkpointed and resumed
# library: apex.optimizers, apex.normalization
# group: amp
# count: extra
# device: written device-agnostic where the originals call .cuda(); fp16 weights on CPU and GPU alike
"""A half-precision BERT-like classifier trained with apex's fused optimizers on the fp16 weights themselves."""
import io

import torch
import torch.nn as nn
import torch.nn.functional as F

# was: from apex.normalization import FusedLayerNorm
from overdrive.apex.normalization import FusedLayerNorm
# was: from apex.optimizers import FusedAdam, FusedLAMB
from overdrive.apex.optimizers import FusedAdam, FusedLAMB

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
VOCAB, HIDDEN, SEQ, LOSS_SCALE = 512, 32, 12, 128.0


class TinyBert(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.LayerNorm = FusedLayerNorm(HIDDEN, eps=1e-12)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.output_LayerNorm = FusedLayerNorm(HIDDEN, eps=1e-12)
        self.classifier = nn.Linear(HIDDEN, 3)

    def forward(self, input_ids):
        h = self.LayerNorm(self.word_embeddings(input_ids))
        h = self.output_LayerNorm(h + F.gelu(self.dense(h)))
        return self.classifier(h[:, 0])


def grouped(model):
    no_decay = ["bias", "gamma", "beta", "LayerNorm"]
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def train(model, optimizer, batches):
    losses = []
    for input_ids, labels in batches:
        loss = F.cross_entropy(model(input_ids).float(), labels)
        (loss * LOSS_SCALE).backward()
        for p in model.parameters():  # fairseq's memory-efficient fp16: unscale the fp16 grads in place
            if p.grad is not None:
                p.grad.mul_(1.0 / LOSS_SCALE)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# only the first 64 tokens of the vocabulary occur: most embedding rows never get a gradient
batches = [(torch.randint(0, 64, (8, SEQ), device=device), torch.randint(0, 3, (8,), device=device))
           for _ in range(6)]

model = TinyBert().to(device).half()
optimizer = FusedAdam(grouped(model), lr=5e-3, bias_correction=False)
losses = train(model, optimizer, batches * 2)
assert all(torch.isfinite(p).all() for p in model.parameters()), "NaN weights in the untouched embedding rows"
assert losses[-1] < losses[0], losses
assert optimizer.param_groups[1]["weight_decay"] == 0.0 and not optimizer.param_groups[1]["bias_correction"]

# DLE BERT pretraining's optimizer on the same kind of model, saved and resumed mid-run
model = TinyBert().to(device).half()
optimizer = FusedLAMB(grouped(model), lr=5e-3, max_grad_norm=1.0)
train(model, optimizer, batches[:3])
buffer = io.BytesIO()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
buffer.seek(0)
checkpoint = torch.load(buffer, map_location=device)
resumed = TinyBert().to(device).half()
resumed.load_state_dict(checkpoint["model"])
resumed_optimizer = FusedLAMB(grouped(resumed), lr=5e-3, max_grad_norm=1.0)
resumed_optimizer.load_state_dict(checkpoint["optimizer"])
train(model, optimizer, batches[3:])
train(resumed, resumed_optimizer, batches[3:])
for a, b in zip(resumed.parameters(), model.parameters()):
    assert torch.equal(a, b), "the resumed run left the uninterrupted one"
print(f"half BERT-like, FusedAdam: loss {losses[0]:.4f} -> {losses[-1]:.4f}; FusedLAMB resumed exactly")
