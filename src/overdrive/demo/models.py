"""The demo's models: they live in :mod:`overdrive.recipes.models`."""

from overdrive.recipes.models import BasicBlock, ConvBNReLU, DigitsCNN, ResidualBlock, ResNet

__all__ = ["BasicBlock", "ConvBNReLU", "DigitsCNN", "ResidualBlock", "ResNet"]
