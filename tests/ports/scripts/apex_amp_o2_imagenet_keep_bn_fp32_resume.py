# source: apex examples/imagenet/main_amp.py run as `--opt-level O2 --keep-batchnorm-fp32 True --loss-scale dynamic --channels-last True`, then again with `--resume checkpoint.pth.tar`; validate() under torch.no_grad()
# library: apex.amp, apex.fp16_utils
# group: amp
# device: written device-agnostic (device = "cuda" if available else "cpu"; main_amp.py's map_location puts the storage on args.gpu)
"""main_amp.py's O2 path: argparse strings for keep_batchnorm_fp32/loss_scale, channels_last, and the --resume block."""
import argparse
import os

import torch
import torch.nn as nn

# was: from apex.fp16_utils import to_python_float
from overdrive.apex.fp16_utils import to_python_float
# was: from apex import amp
from overdrive.apex import amp

device = "cuda" if torch.cuda.is_available() else "cpu"

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", default=3, type=int)
parser.add_argument("--lr", default=0.1, type=float)
parser.add_argument("--opt-level", type=str, default="O2")
parser.add_argument("--keep-batchnorm-fp32", type=str, default="True")
parser.add_argument("--loss-scale", type=str, default="dynamic")
parser.add_argument("--channels-last", type=bool, default=True)
parser.add_argument("--resume", default="", type=str)


def small_resnet():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


def loader(seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.arange(64) % 4
    images = torch.randn(64, 3, 8, 8, generator=g) * 0.5
    images[torch.arange(64), target % 3] += 1.0 + (target // 3).float().view(-1, 1, 1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, target), batch_size=16)


def validate(val_loader, model, criterion):
    model.eval()
    total, n = 0.0, 0
    for input, target in val_loader:
        input, target = input.to(device).contiguous(memory_format=memory_format), target.to(device)
        with torch.no_grad():
            output = model(input)
            loss = criterion(output, target)
        total += to_python_float(loss) * input.size(0)
        n += input.size(0)
    return total / n


def main(argv):
    global args, memory_format
    args = parser.parse_args(argv)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = small_resnet().to(device).to(memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)
    criterion = nn.CrossEntropyLoss().to(device)
    args.start_epoch = 0

    if args.resume:
        def resume():
            if os.path.isfile(args.resume):
                print("=> loading checkpoint '{}'".format(args.resume))
                checkpoint = torch.load(args.resume, map_location=torch.device(device),
                                        weights_only=False)
                args.start_epoch = checkpoint["epoch"]
                model.load_state_dict(checkpoint["state_dict"])
                optimizer.load_state_dict(checkpoint["optimizer"])
            else:
                raise FileNotFoundError(args.resume)
        resume()

    val_loss = [validate(loader(1), model, criterion)]
    for epoch in range(args.start_epoch, args.start_epoch + args.epochs):
        model.train()
        for input, target in loader(0):
            input, target = input.to(device).contiguous(memory_format=memory_format), target.to(device)
            loss = criterion(model(input), target)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        val_loss.append(validate(loader(1), model, criterion))
        torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
                   "checkpoint.pth.tar")
    return model, optimizer, val_loss


if __name__ == "__main__":
    model, optimizer, first_run = main([])
    half = model[0].weight.dtype
    assert half in (torch.float16, torch.bfloat16)
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32  # kept fp32
    assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))
    assert first_run[-1] < 0.7 * first_run[0], first_run

    saved = torch.load("checkpoint.pth.tar", weights_only=False)
    model, optimizer, resumed = main(["--resume", "checkpoint.pth.tar", "--epochs", "1"])
    assert abs(resumed[0] - first_run[-1]) < 1e-6, (resumed, first_run)  # the resumed model is the saved one
    # one more epoch from the restored weights and fp32 masters beats one epoch from scratch (stale masters would not)
    assert resumed[-1] < min(first_run[1], first_run[-1]), (resumed, first_run)
    assert torch.load("checkpoint.pth.tar", weights_only=False)["epoch"] == saved["epoch"] + 1 == 4
