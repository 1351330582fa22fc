# source: Hugging Face transformers examples/run_glue.py (v2-v3, --fp16): `try: from apex import amp except ImportError: raise ImportError("Please install apex ...")`, amp.initialize(model, optimizer, opt_level=args.fp16_opt_level) before DataParallel, gradient accumulation, clip_grad_norm_(amp.master_params(optimizer)), optimizer.step(); scheduler.step(); model.zero_grad()
# library: apex.amp
# group: amp
# device: written device-agnostic (args.device = "cuda" if available else "cpu")
"""run_glue.py's --fp16 code path at toy size, with --fp16_opt_level O1 (the default) and O2, against --fp16 off."""
import argparse

import torch
import torch.nn as nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))
    return LambdaLR(optimizer, lr_lambda, last_epoch)


class TinyForSequenceClassification(nn.Module):
    def __init__(self, vocab=50, hidden=32, num_labels=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)
        self.classifier = nn.Linear(hidden, num_labels)
        self.num_labels = num_labels

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        h = self.LayerNorm(torch.tanh(self.dense(self.embeddings(input_ids))))
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(1) / mask.sum(1)
        logits = self.classifier(pooled)
        outputs = (logits,)
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()
            loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
            outputs = (loss,) + outputs
        return outputs


def train_dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (96, 10), generator=g)
    lengths = torch.randint(4, 11, (96,), generator=g)
    attention = (torch.arange(10).view(1, -1) < lengths.view(-1, 1)).long()
    ids = ids * attention
    labels = ((ids < 25) & (ids > 0)).sum(1).gt(lengths // 2).long()  # mostly small token ids -> label 1
    return torch.utils.data.TensorDataset(ids, attention, torch.zeros_like(ids), labels)


def train(args, train_dataset, model):
    train_dataloader = torch.utils.data.DataLoader(train_dataset, batch_size=args.train_batch_size)
    t_total = len(train_dataloader) // args.gradient_accumulation_steps * args.num_train_epochs
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = AdamW(optimizer_grouped_parameters, lr=args.learning_rate, eps=args.adam_epsilon)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=args.warmup_steps,
                                                num_training_steps=t_total)
    if args.fp16:
        try:
            # was: from apex import amp
            from overdrive.apex import amp
        except ImportError:
            raise ImportError("Please install apex from https://www.github.com/nvidia/apex to use fp16 training.")
        model, optimizer = amp.initialize(model, optimizer, opt_level=args.fp16_opt_level)

    # multi-gpu training (should be after apex fp16 initialization)
    if args.n_gpu > 1:
        model = torch.nn.DataParallel(model)

    global_step = 0
    tr_loss, logging_loss = 0.0, 0.0
    epoch_losses = []
    model.zero_grad()
    for _ in range(args.num_train_epochs):
        epoch_loss = 0.0
        for step, batch in enumerate(train_dataloader):
            model.train()
            batch = tuple(t.to(args.device) for t in batch)
            inputs = {"input_ids": batch[0], "attention_mask": batch[1], "labels": batch[3]}
            outputs = model(**inputs)
            loss = outputs[0]  # model outputs are always tuple in transformers (see doc)
            if args.gradient_accumulation_steps > 1:
                loss = loss / args.gradient_accumulation_steps
            if args.fp16:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            tr_loss += loss.item()
            epoch_loss += loss.item()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                if args.fp16:
                    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.max_grad_norm)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()  # Update learning rate schedule
                model.zero_grad()
                global_step += 1
        epoch_losses.append(epoch_loss)
    return global_step, tr_loss / global_step, epoch_losses


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=2e-2)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--adam_epsilon", type=float, default=1e-8)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_train_epochs", type=int, default=4)
    parser.add_argument("--warmup_steps", type=int, default=2)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--fp16_opt_level", type=str, default="O1")
    args = parser.parse_args(argv)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.n_gpu = 0 if args.device.type == "cpu" else 1
    torch.manual_seed(42)
    model = TinyForSequenceClassification().to(args.device)
    return train(args, train_dataset(), model)


if __name__ == "__main__":
    _, _, fp32 = main([])
    for level in ("O1", "O2"):
        steps, avg, losses = main(["--fp16", "--fp16_opt_level", level])
        assert steps == 24
        assert losses[-1] < 0.6 * losses[0], (level, losses)
        # every epoch's loss follows the fp32 run to half-precision rounding (rtol 5e-2): a master gradient kept
        # across model.zero_grad(), or one unscaled twice, would not
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=5e-2, atol=0, msg=level)
