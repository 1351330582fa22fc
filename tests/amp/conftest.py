from __future__ import annotations

import pytest
import torch
from torch import nn


class Net(nn.Module):
    """Conv + BN + LayerNorm + Linear: every kind of layer the opt levels treat differently."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))  # (B, 8)
        return self.fc(self.ln(h))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.fixture(autouse=True)
def _no_autocast_left_on():
    """apex's O1 keeps autocast on from a training forward until scale_loss, the optimizer step, or the
    forward's outputs being freed; none may outlive the test that ran it."""
    yield
    assert not torch.is_autocast_enabled("cpu"), "a test left torch.autocast on"
