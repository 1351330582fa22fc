# source: apex examples/imagenet/main_amp.py: argparse flags (--opt-level O1), SGD with momentum, amp.initialize, amp.scale_loss, AverageMeter + accuracy + to_python_float, save_checkpoint
# library: apex.amp, apex.fp16_utils, apex.parallel
# group: amp
# device: written device-agnostic (device = "cuda" if available else "cpu") where main_amp.py calls .cuda(); its CUDA-stream data_prefetcher is a plain loop here
"""An ImageNet-style training script in the shape of apex's examples/imagenet/main_amp.py, at a toy size."""
import argparse
import os
import shutil
import time

import torch
import torch.nn as nn
import torch.distributed as dist

# was: from apex.parallel import DistributedDataParallel as DDP
from overdrive.apex.parallel import DistributedDataParallel as DDP
# was: from apex.fp16_utils import *
from overdrive.apex.fp16_utils import *
# was: from apex import amp
from overdrive.apex import amp

device = "cuda" if torch.cuda.is_available() else "cpu"

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("--epochs", default=3, type=int)
parser.add_argument("-b", "--batch-size", default=16, type=int)
parser.add_argument("--lr", "--learning-rate", default=0.4, type=float)
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--weight-decay", "--wd", default=1e-4, type=float)
parser.add_argument("--print-freq", "-p", default=1, type=int)
parser.add_argument("--opt-level", type=str, default="O1")
parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
parser.add_argument("--loss-scale", type=str, default=None)
parser.add_argument("--local_rank", default=0, type=int)


class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    maxk = max(topk)
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    res = []
    for k in topk:
        correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
        res.append(correct_k.mul_(100.0 / batch_size))
    return res


def reduce_tensor(tensor):
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    rt /= args.world_size
    return rt


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


def small_resnet(num_classes=4):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def fake_imagenet(n=64, num_classes=4):
    g = torch.Generator().manual_seed(0)
    target = torch.arange(n) % num_classes
    images = torch.randn(n, 3, 8, 8, generator=g) * 0.5
    images[torch.arange(n), target % 3] += 1.0 + (target // 3).float().view(-1, 1, 1)  # a learnable signal
    return torch.utils.data.TensorDataset(images, target)


def train(train_loader, model, criterion, optimizer, epoch):
    batch_time = AverageMeter()
    losses = AverageMeter()
    top1 = AverageMeter()
    model.train()
    end = time.time()
    for i, (input, target) in enumerate(train_loader):
        input, target = input.to(device), target.to(device)
        output = model(input)
        loss = criterion(output, target)

        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

        if i % args.print_freq == 0:
            prec1, = accuracy(output.data, target, topk=(1,))
            if args.distributed:
                reduced_loss = reduce_tensor(loss.data)
                prec1 = reduce_tensor(prec1)
            else:
                reduced_loss = loss.data
            losses.update(to_python_float(reduced_loss), input.size(0))
            top1.update(to_python_float(prec1), input.size(0))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            batch_time.update((time.time() - end) / args.print_freq)
            end = time.time()
    return losses.avg, top1.avg


def main():
    global args
    args = parser.parse_args()
    args.distributed = False
    if "WORLD_SIZE" in os.environ:
        args.distributed = int(os.environ["WORLD_SIZE"]) > 1
    args.world_size = 1
    torch.manual_seed(0)

    model = small_resnet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
    if args.distributed:
        model = DDP(model, delay_allreduce=True)
    criterion = nn.CrossEntropyLoss().to(device)

    train_loader = torch.utils.data.DataLoader(fake_imagenet(), batch_size=args.batch_size, shuffle=True,
                                               generator=torch.Generator().manual_seed(0))
    history = []
    best_prec1 = 0
    for epoch in range(args.epochs):
        loss, prec1 = train(train_loader, model, criterion, optimizer, epoch)
        history.append((loss, prec1))
        is_best = prec1 > best_prec1
        best_prec1 = max(prec1, best_prec1)
        save_checkpoint({"epoch": epoch + 1, "arch": "small_resnet", "state_dict": model.state_dict(),
                         "best_prec1": best_prec1, "optimizer": optimizer.state_dict()}, is_best)
    return model, history


if __name__ == "__main__":
    model, history = main()
    (first_loss, first_top1), (last_loss, last_top1) = history[0], history[-1]
    # O1: the convolutions ran in the half dtype, the weights stayed fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.isfinite(torch.tensor(last_loss)) and last_loss < 0.7 * first_loss, history
    assert last_top1 > first_top1, history
    ckpt = torch.load("checkpoint.pth.tar", weights_only=False)
    assert ckpt["epoch"] == 3 and set(ckpt["state_dict"]) == set(model.state_dict())
