"""The demo's model: a small CNN with BatchNorm and a residual add (what quantization and
sparsity stages need to show their rules), sized for 8x8 digits."""

from __future__ import annotations

import torch
from torch import nn


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class ResidualBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = ConvBNReLU(ch, ch)
        self.conv2 = nn.Sequential(nn.Conv2d(ch, ch, 3, 1, 1, bias=False), nn.BatchNorm2d(ch))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(x + self.conv2(self.conv1(x)))


class DigitsCNN(nn.Module):
    """(B, 1, 8, 8) -> (B, 10) logits.

    Example:
        >>> DigitsCNN()(torch.randn(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBNReLU(1, width)  # (B, w, 8, 8)
        self.block1 = ResidualBlock(width)
        self.down = ConvBNReLU(width, 2 * width, stride=2)  # (B, 2w, 4, 4)
        self.block2 = ResidualBlock(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(2 * width, 64)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.fc2(self.act(self.fc1(torch.flatten(self.pool(x), 1))))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN, a projection shortcut where the shape changes, a residual add."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = ConvBNReLU(cin, cout, stride)
        self.conv2 = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.shortcut(x) + self.conv2(self.conv1(x)))


class ResNet(nn.Module):
    """A ResNet-18-style network (BasicBlocks, ``depths`` per stage) for ``in_ch``-channel images.

    ``width=64, stem="imagenet"`` is ResNet-18 itself (7x7/2 stem + max-pool, 224x224 inputs);
    ``stem="small"`` is the CIFAR-style 3x3/1 stem for 32x32 inputs.

    Example:
        >>> ResNet(width=8, stem="small")(torch.randn(2, 1, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, width: int = 64, depths: tuple[int, ...] = (2, 2, 2, 2), stem: str = "imagenet",
                 in_ch: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        if stem == "imagenet":
            self.stem = nn.Sequential(nn.Conv2d(in_ch, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = ConvBNReLU(in_ch, width)
        blocks: list[nn.Module] = []
        cin = width
        for i, depth in enumerate(depths):
            cout = width * 2 ** i
            for j in range(depth):
                blocks.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))
