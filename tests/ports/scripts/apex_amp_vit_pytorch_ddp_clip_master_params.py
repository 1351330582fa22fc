# source: jeonsworld/ViT-pytorch train.py: SGD + WarmupCosineSchedule, amp.initialize(models=model, optimizers=optimizer, opt_level=args.fp16_opt_level) with O2, amp._amp_state.loss_scalers[0]._loss_scale = 2**20, apex DDP(model, message_size=250000000, gradient_predivide_factor=get_world_size()), clip_grad_norm_(amp.master_params(optimizer)), valid() under torch.no_grad(), save_model via model.module
# library: apex.amp, apex.parallel
# group: amp
# device: written device-agnostic (args.device = "cuda" if available else "cpu"); the launcher's env (torch.distributed.launch, one process) is set in the script, with gloo where there is no GPU
"""ViT-pytorch's fine-tuning loop at toy size: O2, a loss-scale override, apex DDP over a world of 1, clipping on masters."""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

# was: from apex import amp
from overdrive.apex import amp
# was: from apex.parallel import DistributedDataParallel as DDP
from overdrive.apex.parallel import DistributedDataParallel as DDP


class WarmupCosineSchedule(LambdaLR):
    def __init__(self, optimizer, warmup_steps, t_total, cycles=.5, last_epoch=-1):
        self.warmup_steps = warmup_steps
        self.t_total = t_total
        self.cycles = cycles
        super(WarmupCosineSchedule, self).__init__(optimizer, self.lr_lambda, last_epoch=last_epoch)

    def lr_lambda(self, step):
        if step < self.warmup_steps:
            return float(step) / float(max(1.0, self.warmup_steps))
        progress = float(step - self.warmup_steps) / float(max(1, self.t_total - self.warmup_steps))
        return max(0.0, 0.5 * (1. + math.cos(math.pi * float(self.cycles) * 2.0 * progress)))


class AverageMeter(object):
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-6)
        self.query, self.key, self.value = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=1e-6)
        self.ffn = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def transpose_for_scores(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.heads, -1).permute(0, 2, 1, 3)

    def forward(self, x):
        h = x
        x = self.attention_norm(x)
        q, k, v = (self.transpose_for_scores(f(x)) for f in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(h.shape)
        x = self.out(ctx) + h
        return self.ffn(self.ffn_norm(x)) + x, probs


class VisionTransformer(nn.Module):
    def __init__(self, img_size=8, patch=4, hidden=32, num_classes=4, zero_head=False):
        super().__init__()
        self.num_classes = num_classes
        self.patch_embeddings = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.position_embeddings = nn.Parameter(torch.randn(1, (img_size // patch) ** 2 + 1, hidden) * 0.02)
        self.block = Block(hidden, heads=2)
        self.encoder_norm = nn.LayerNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x, labels=None):
        x = self.patch_embeddings(x).flatten(2).transpose(-1, -2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.position_embeddings
        x, attn_weights = self.block(x)
        logits = self.head(self.encoder_norm(x)[:, 0])
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()
            return loss_fct(logits.view(-1, self.num_classes), labels.view(-1))
        return logits, attn_weights


def get_world_size():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dataset(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4
    x = torch.randn(n, 3, 8, 8, generator=g) * 0.3
    x[torch.arange(n), y % 3, :4] += 1.0  # the class is in which channel's top half is bright
    x[:, :, 4:] += (y // 3).float().view(-1, 1, 1, 1)
    return torch.utils.data.TensorDataset(x, y)


def valid(args, model, test_loader):
    eval_losses = AverageMeter()
    model.eval()
    all_preds, all_label = [], []
    loss_fct = torch.nn.CrossEntropyLoss()
    for step, batch in enumerate(test_loader):
        batch = tuple(t.to(args.device) for t in batch)
        x, y = batch
        with torch.no_grad():
            logits = model(x)[0]
            eval_loss = loss_fct(logits, y)
            eval_losses.update(eval_loss.item())
            preds = torch.argmax(logits, dim=-1)
        all_preds.append(preds)
        all_label.append(y)
    return (torch.cat(all_preds) == torch.cat(all_label)).float().mean().item()


def save_model(args, model):
    model_to_save = model.module if hasattr(model, "module") else model
    model_checkpoint = os.path.join(args.output_dir, "%s_checkpoint.bin" % args.name)
    torch.save(model_to_save.state_dict(), model_checkpoint)


def train(args, model):
    train_loader = torch.utils.data.DataLoader(dataset(0), batch_size=args.train_batch_size, shuffle=True,
                                               generator=torch.Generator().manual_seed(args.seed))
    test_loader = torch.utils.data.DataLoader(dataset(1), batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9,
                                weight_decay=args.weight_decay)
    t_total = args.num_steps
    scheduler = WarmupCosineSchedule(optimizer, warmup_steps=args.warmup_steps, t_total=t_total)
    if args.fp16:
        model, optimizer = amp.initialize(models=model, optimizers=optimizer, opt_level=args.fp16_opt_level)
        amp._amp_state.loss_scalers[0]._loss_scale = 2**20
    # Distributed training
    if args.local_rank != -1:
        model = DDP(model, message_size=250000000, gradient_predivide_factor=get_world_size())
    model.zero_grad()
    losses = AverageMeter()
    global_step, best_acc, history = 0, 0, []
    accuracies = [valid(args, model, test_loader)]
    while True:
        model.train()
        for step, batch in enumerate(train_loader):
            batch = tuple(t.to(args.device) for t in batch)
            x, y = batch
            loss = model(x, y)
            if args.gradient_accumulation_steps > 1:
                loss = loss / args.gradient_accumulation_steps
            if args.fp16:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                losses.update(loss.item() * args.gradient_accumulation_steps)
                if args.fp16:
                    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.max_grad_norm)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                scheduler.step()
                optimizer.step()
                optimizer.zero_grad()
                global_step += 1
                history.append(losses.val)
                if global_step % args.eval_every == 0 and args.local_rank in [-1, 0]:
                    accuracy = valid(args, model, test_loader)
                    accuracies.append(accuracy)
                    if best_acc < accuracy:
                        save_model(args, model)
                        best_acc = accuracy
                    model.train()
                if global_step % t_total == 0:
                    break
        losses.reset()
        if global_step % t_total == 0:
            break
    return model, optimizer, history, accuracies


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="toy")
    parser.add_argument("--output_dir", default=".")
    parser.add_argument("--train_batch_size", default=16, type=int)
    parser.add_argument("--eval_every", default=8, type=int)
    parser.add_argument("--learning_rate", default=3e-2, type=float)
    parser.add_argument("--weight_decay", default=0, type=float)
    parser.add_argument("--num_steps", default=16, type=int)
    parser.add_argument("--warmup_steps", default=3, type=int)
    parser.add_argument("--max_grad_norm", default=1.0, type=float)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--fp16", action="store_true", default=True)
    parser.add_argument("--fp16_opt_level", type=str, default="O2")
    args = parser.parse_args([])

    # what torch.distributed.launch --nproc_per_node=1 would have set
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(args.local_rank)
        args.device = torch.device("cuda", args.local_rank)
    else:
        args.device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        torch.manual_seed(args.seed)
        model = VisionTransformer(num_classes=4, zero_head=True).to(args.device)
        model, optimizer, history, accuracies = train(args, model)
        scaler = amp._amp_state.loss_scalers[0]
        assert scaler.loss_scale() == 2.0**20  # the script's override was the scale used (no overflow in bf16)
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))
        assert all(math.isfinite(v) for v in history) and sum(history[-4:]) < 0.5 * sum(history[:4]), history
        assert max(accuracies) >= 0.75 and accuracies[0] <= 0.5, accuracies
        saved = torch.load(os.path.join(args.output_dir, "%s_checkpoint.bin" % args.name))
        assert saved.keys() == model.module.state_dict().keys()
    finally:
        dist.destroy_process_group()
