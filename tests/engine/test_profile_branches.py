"""A dynamic shape profile over a model that branches on a size: the engine must not keep one branch for the whole
range (it returned the batch <= 4 branch for batches 5..8, both backends). Reference: the model itself at the
profile's max shape; the build refuses, naming the range the model holds for."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, BuildConfig, ShapeProfile


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y * 2 if x.shape[0] > 4 else y


def test_inductor_refuses_a_profile_the_export_narrowed() -> None:
    cfg = BuildConfig(backend="inductor", profiles=(ShapeProfile("x", (1, 16), (2, 16), (8, 16)),))
    with pytest.raises(UsageError, match=r"input 'x' dim 0: the shape profile lets it vary \(1..8\) but the model only "
                                         r"holds for 1..4"):
        Builder(cfg).build(_Branch().eval(), (torch.randn(2, 16),), input_names=["x"])


def test_onnxruntime_refuses_an_export_that_keeps_one_branch() -> None:
    pytest.importorskip("onnxruntime")
    cfg = BuildConfig(backend="onnxruntime", profiles=(ShapeProfile("x", (1, 16), (2, 16), (8, 16)),))
    with pytest.raises(UsageError, match="does not compute what the model does across the shape profile"):
        Builder(cfg).build(_Branch().eval(), (torch.randn(2, 16),), input_names=["x"])


def test_a_profile_inside_the_branch_builds_and_matches() -> None:
    model = _Branch().eval()
    cfg = BuildConfig(backend="inductor", profiles=(ShapeProfile("x", (1, 16), (2, 16), (4, 16)),))
    eng = Builder(cfg).build(model, (torch.randn(2, 16),), input_names=["x"])
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(eng(x), model(x), rtol=1e-5, atol=1e-5)
