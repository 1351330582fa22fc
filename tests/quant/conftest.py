from __future__ import annotations

import pytest
import torch

from overdrive.recipes.models import DigitsCNN


@pytest.fixture(scope="module")
def digits():
    from overdrive.recipes.data import load_digits

    return load_digits()


def train_briefly(model: torch.nn.Module, digits, lr: float, epochs: int, batch_size: int) -> torch.nn.Module:
    """Seeded fp32 AdamW training on the digits for the quantization tests; returns the model in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    train, _ = digits.loaders(batch_size=batch_size, seed=0)
    for _ in range(epochs):
        for x, y in train:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def trainer():
    return train_briefly


@pytest.fixture(scope="module")
def trained_cnn(digits):
    """The digits CNN trained briefly in fp32 (about 1 s on 2 idle cores), reused by the module's tests."""
    torch.manual_seed(0)
    return train_briefly(DigitsCNN(), digits, lr=3e-3, epochs=2, batch_size=64)


@pytest.fixture(scope="module")
def accuracy():
    return _accuracy


def _accuracy(model, digits) -> float:
    with torch.no_grad():
        return float((model(digits.x_test).argmax(1) == digits.y_test).float().mean())
