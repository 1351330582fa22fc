# source: Hugging Face transformers examples/run_squad.py (v2-v3, --fp16): `import apex; apex.amp.register_half_function(torch, "einsum")` in main() before the model is built, then amp.initialize(model, optimizer, opt_level=args.fp16_opt_level) in train(), start/end CrossEntropy averaged, clip on amp.master_params
# library: apex.amp
# group: amp
# device: written device-agnostic (args.device = "cuda" if available else "cpu")
"""run_squad.py's apex set-up: einsum registered as a half function for an einsum-attention model (as XLNet's)."""
import argparse

import torch
import torch.nn as nn


class EinsumQA(nn.Module):
    def __init__(self, vocab=16, hidden=32):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(12, hidden)
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)
        self.qa_outputs = nn.Linear(hidden, 2)
        self.score_dtype = None

    def forward(self, input_ids, start_positions=None, end_positions=None):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        scores = torch.einsum("bid,bjd->bij", self.q(h), self.k(h)) / h.size(-1) ** 0.5
        self.score_dtype = scores.dtype
        h = self.LayerNorm(h + torch.einsum("bij,bjd->bid", scores.softmax(-1), self.v(h)))
        start_logits, end_logits = self.qa_outputs(h).split(1, dim=-1)
        start_logits, end_logits = start_logits.squeeze(-1), end_logits.squeeze(-1)
        outputs = (start_logits, end_logits)
        if start_positions is not None and end_positions is not None:
            loss_fct = nn.CrossEntropyLoss()
            start_loss = loss_fct(start_logits, start_positions)
            end_loss = loss_fct(end_logits, end_positions)
            total_loss = (start_loss + end_loss) / 2
            outputs = (total_loss,) + outputs
        return outputs


def squad_like(seed, n=96):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (n, 12), generator=g)
    start = torch.randint(0, 9, (n,), generator=g)
    end = start + torch.randint(1, 3, (n,), generator=g)
    ids[torch.arange(n), start] = 1  # the answer opens at token 1 and closes at token 2
    ids[torch.arange(n), end] = 2
    return torch.utils.data.TensorDataset(ids, start, end)


def evaluate(args, model):
    model.eval()
    ids, start, end = squad_like(seed=1).tensors
    with torch.no_grad():
        start_logits, end_logits = model(ids.to(args.device))
    exact = (start_logits.argmax(-1).cpu() == start) & (end_logits.argmax(-1).cpu() == end)
    return exact.float().mean().item()


def train(args, train_dataset, model):
    train_dataloader = torch.utils.data.DataLoader(train_dataset, batch_size=16, shuffle=True,
                                                   generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, eps=1e-8)
    if args.fp16:
        try:
            # was: from apex import amp
            from overdrive.apex import amp
        except ImportError:
            raise ImportError("Please install apex from https://www.github.com/nvidia/apex to use fp16 training.")
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.fp16_opt_level)
    losses, dtypes = [], set()
    model.zero_grad()
    for _ in range(args.num_train_epochs):
        for step, batch in enumerate(train_dataloader):
            model.train()
            batch = tuple(t.to(args.device) for t in batch)
            inputs = {"input_ids": batch[0], "start_positions": batch[1], "end_positions": batch[2]}
            outputs = model(**inputs)
            loss = outputs[0]
            dtypes.add(model.score_dtype)
            if args.fp16:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            if args.fp16:
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            model.zero_grad()
            losses.append(loss.item())
    return losses, dtypes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning_rate", default=1e-2, type=float)
    parser.add_argument("--num_train_epochs", default=6, type=int)
    parser.add_argument("--max_grad_norm", default=1.0, type=float)
    parser.add_argument("--fp16", action="store_true", default=True)
    parser.add_argument("--fp16_opt_level", type=str, default="O1")
    args = parser.parse_args([])
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if args.fp16:
        try:
            # was: import apex
            import overdrive.apex as apex
            apex.amp.register_half_function(torch, "einsum")
        except ImportError:
            raise ImportError("Please install apex from https://www.github.com/nvidia/apex to use fp16 training.")

    torch.manual_seed(0)
    model = EinsumQA().to(args.device)
    before = evaluate(args, model)
    losses, dtypes = train(args, squad_like(seed=0), model)
    return before, evaluate(args, model), losses, dtypes


if __name__ == "__main__":
    before, after, losses, dtypes = main()
    # apex ran the registered einsum in half: here autocast does, in training forwards
    assert dtypes == {torch.bfloat16} or dtypes == {torch.float16}, dtypes
    assert losses[-1] < 0.5 * losses[0], losses
    assert after > before + 0.3, (before, after)
