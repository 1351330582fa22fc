"""The demo's real dataset: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes).

It ships inside scikit-learn, so the demo needs no download.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, TensorDataset

from overdrive._utils.optional import require


@dataclass
class Digits:
    x_train: torch.Tensor  # (N, 1, 8, 8) float32 in [0, 1]
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor

    def loaders(self, batch_size: int = 64, seed: int = 0) -> tuple[DataLoader, DataLoader]:
        g = torch.Generator().manual_seed(seed)
        train = DataLoader(TensorDataset(self.x_train, self.y_train), batch_size=batch_size, shuffle=True,
                           generator=g, drop_last=True)
        test = DataLoader(TensorDataset(self.x_test, self.y_test), batch_size=256)
        return train, test

    def calibration_batches(self, n: int = 4, batch_size: int = 64) -> list[torch.Tensor]:
        """A few training batches (no labels) for calibrating quantizers."""
        return [self.x_train[i * batch_size:(i + 1) * batch_size] for i in range(n)]


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """Split digits into train/test, stratified and seeded.

    Example:
        >>> d = load_digits()
        >>> d.x_train.shape[1:], int(d.y_train.max())
        (torch.Size([1, 8, 8]), 9)
    """
    datasets = require("sklearn.datasets", extra="demo", feature="the demo's digits dataset")
    raw = datasets.load_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(raw.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    train_idx, test_idx = [], []
    for c in range(10):  # stratified split
        idx = (y == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        k = round(len(idx) * test_fraction)
        test_idx.append(idx[:k])
        train_idx.append(idx[k:])
    tr, te = torch.cat(train_idx), torch.cat(test_idx)
    tr = tr[torch.randperm(len(tr), generator=g)]
    return Digits(x[tr], y[tr], x[te], y[te])
