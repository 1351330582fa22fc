"""Shared fixtures: the digits CNN and its ONNX export (exported once per session: the dynamo exporter
takes several seconds)."""

from __future__ import annotations

import pytest
import torch

from overdrive.recipes.models import DigitsCNN
from overdrive.engine import ShapeProfile

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

DYN = [ShapeProfile("x", (1, 1, 8, 8), (4, 1, 8, 8), (32, 1, 8, 8))]


@pytest.fixture(scope="session")
def digits() -> torch.nn.Module:
    torch.manual_seed(0)
    m = DigitsCNN().eval()
    with torch.no_grad():  # non-trivial BN statistics so folding errors would show
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
    return m


@pytest.fixture(scope="session")
def digits_onnx(digits: torch.nn.Module) -> bytes:
    from overdrive.engine.sources import from_module

    return from_module(digits).as_onnx((torch.randn(4, 1, 8, 8),), DYN)
