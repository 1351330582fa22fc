# source: NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT run_pretraining.py: FusedLAMB over no_decay param groups, amp.initialize(O2, loss_scale="dynamic", cast_model_outputs=torch.float16), amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale, gradient accumulation with delay_overflow_check, param.grad = None, checkpoint with 'master params', and the resume path (optimizer._lazy_init_maybe_master_weights(), optimizer._amp_stash.lazy_init_called, copy into amp.master_params)
# library: apex.amp, apex.optimizers
# group: amp
# device: written device-agnostic (device = "cuda" if available else "cpu") where run_pretraining.py uses torch.device("cuda", args.local_rank)
"""DLE BERT pretraining's apex code paths at toy size (the non-allreduce_post_accumulation path)."""
import argparse
import os

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

# was: from apex.optimizers import FusedLAMB
from overdrive.apex.optimizers import FusedLAMB
# was: from apex import amp
from overdrive.apex import amp
# was: from apex.amp import _amp_state
from overdrive.apex.amp import _amp_state

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB, HIDDEN, SEQ = 32, 32, 12

parser = argparse.ArgumentParser()
parser.add_argument("--learning_rate", type=float, default=2e-2)
parser.add_argument("--max_steps", type=int, default=12)
parser.add_argument("--warmup_proportion", type=float, default=0.1)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--fp16", default=True, action="store_true")
parser.add_argument("--loss_scale", type=float, default=0.0)
parser.add_argument("--init_loss_scale", type=int, default=2**20)
parser.add_argument("--allreduce_post_accumulation", default=False, action="store_true")
parser.add_argument("--resume_from_checkpoint", default=False, action="store_true")
parser.add_argument("--output_dir", default=".")


class BertForPreTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN)
        self.encoder = nn.TransformerEncoderLayer(HIDDEN, 2, 2 * HIDDEN, dropout=0.0, batch_first=True)
        self.cls_predictions = nn.Linear(HIDDEN, VOCAB)
        self.cls_seq_relationship = nn.Linear(HIDDEN, 2)

    def forward(self, input_ids):
        h = self.encoder(self.LayerNorm(self.embeddings(input_ids)))
        return self.cls_predictions(h), self.cls_seq_relationship(h[:, 0])


class BertPretrainingCriterion(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=-1)
        self.vocab_size = vocab_size

    def forward(self, prediction_scores, seq_relationship_score, masked_lm_labels, next_sentence_labels):
        masked_lm_loss = self.loss_fn(prediction_scores.view(-1, self.vocab_size).float(), masked_lm_labels.view(-1))
        next_sentence_loss = self.loss_fn(seq_relationship_score.view(-1, 2).float(), next_sentence_labels.view(-1))
        return masked_lm_loss + next_sentence_loss


def batches(n):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (8, SEQ), generator=g)
        labels = torch.where(torch.rand(8, SEQ, generator=g) < 0.3, ids, torch.full_like(ids, -1))
        yield ids.to(device), labels.to(device), (ids[:, 0] < VOCAB // 2).long().to(device)


def prepare_model_and_optimizer(args, checkpoint=None):
    torch.manual_seed(0)
    model = BertForPreTraining().to(device)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"], strict=False)
    param_optimizer = list(model.named_parameters())
    no_decay = ["bias", "gamma", "beta", "LayerNorm"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    optimizer = FusedLAMB(optimizer_grouped_parameters, lr=args.learning_rate)
    warmup = max(1, int(args.warmup_proportion * args.max_steps))
    lr_scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1 - s / args.max_steps) ** 0.5)
    if args.fp16:
        if args.loss_scale == 0:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic",
                                              cast_model_outputs=torch.float16)
        else:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=args.loss_scale,
                                              cast_model_outputs=torch.float16)
        amp._amp_state.loss_scalers[0]._loss_scale = args.init_loss_scale

    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        # Restore AMP master parameters
        if args.fp16:
            optimizer._lazy_init_maybe_master_weights()
            optimizer._amp_stash.lazy_init_called = True
            optimizer.load_state_dict(checkpoint["optimizer"])
            for param, saved_param in zip(amp.master_params(optimizer), checkpoint["master params"]):
                param.data.copy_(saved_param.data)
    criterion = BertPretrainingCriterion(VOCAB)
    return model, optimizer, lr_scheduler, criterion


def take_optimizer_step(args, optimizer, model, global_step):
    optimizer.step()
    # optimizer.zero_grad()
    for param in model.parameters():
        param.grad = None
    global_step += 1
    return global_step


def main(args, checkpoint=None):
    model, optimizer, lr_scheduler, criterion = prepare_model_and_optimizer(args, checkpoint)
    global_step, training_steps, average_loss, losses = 0, 0, 0.0, []
    model.train()
    for input_ids, masked_lm_labels, next_sentence_labels in batches(args.max_steps * args.gradient_accumulation_steps):
        training_steps += 1
        prediction_scores, seq_relationship_score = model(input_ids)
        loss = criterion(prediction_scores, seq_relationship_score, masked_lm_labels, next_sentence_labels)
        if args.gradient_accumulation_steps > 1:
            if not args.allreduce_post_accumulation:
                # this division was merged into predivision
                loss = loss / args.gradient_accumulation_steps
        if args.fp16:
            with amp.scale_loss(loss, optimizer, delay_overflow_check=args.allreduce_post_accumulation) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        average_loss += loss.item()
        if training_steps % args.gradient_accumulation_steps == 0:
            lr_scheduler.step()  # learning rate warmup
            global_step = take_optimizer_step(args, optimizer, model, global_step)
            losses.append(average_loss)
            print({"step": global_step, "average_loss": average_loss, "learning_rate": optimizer.param_groups[0]["lr"],
                   "loss_scale": _amp_state.loss_scalers[0].loss_scale()})
            average_loss = 0.0
    model_to_save = model.module if hasattr(model, "module") else model
    output_save_file = os.path.join(args.output_dir, "ckpt_{}.pt".format(global_step))
    torch.save({"model": model_to_save.state_dict(),
                "optimizer": optimizer.state_dict(),
                "master params": list(amp.master_params(optimizer)),
                "global_step": global_step}, output_save_file)
    return model, optimizer, losses, output_save_file


if __name__ == "__main__":
    args = parser.parse_args([])
    model, optimizer, losses, path = main(args)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.loss_scale() == 2.0**20 and scaler.dynamic  # the script's initial scale was used
    with torch.no_grad():
        assert model(next(batches(1))[0])[0].dtype == torch.float16  # cast_model_outputs
    stash = optimizer._amp_stash
    assert all(p.dtype == torch.float32 for p in stash.all_fp32_from_fp16_params)
    assert {p.dtype for p in stash.all_fp16_params} == {model.cls_predictions.weight.dtype} != {torch.float32}
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.8 * losses[0], losses

    # resume from the checkpoint as run_pretraining.py does (here with another --init_loss_scale): the masters
    # come back, and loss_scalers[0] is the resumed run's scaler even though the first run is still alive
    saved = torch.load(path, weights_only=False)
    args2 = parser.parse_args(["--init_loss_scale", str(2**18)])
    model2, optimizer2, lr_scheduler2, criterion2 = prepare_model_and_optimizer(args2, checkpoint=saved)
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**18
    assert _amp_state.opt_properties.master_weights and len(optimizer2._amp_stash.all_fp32_from_fp16_params) > 0
    for restored, ref in zip(amp.master_params(optimizer2), saved["master params"]):
        assert restored.dtype == torch.float32 and torch.equal(restored, ref)  # tolerance 0
    x = next(batches(1))[0]
    with torch.no_grad():
        assert torch.equal(model2(x)[0], model(x)[0])
    with amp.scale_loss(criterion2(*model2(x), *next(batches(1))[1:]), optimizer2) as scaled_loss:
        scaled_loss.backward()
    optimizer2.step()  # the resumed run steps with its own scale, masters and optimizer state
    assert scaler.loss_scale() == 2.0**20 and _amp_state.loss_scalers[0].loss_scale() == 2.0**18
