"""A PyTorch model built with a dynamic profile on the onnxruntime backend goes through the TorchScript ONNX
exporter, which traces Python code on sizes at the example's sizes. A loop over the sequence ran 8 steps at every
length: at T=12 and T=16 the engine's outputs were 1.3-1.8 off the module with no error. The export is now run at
another size in every dynamic dim and kept only when it matches the module; else the dynamo exporter decides
(it refuses the dim, as the inductor backend's torch.export does)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive._utils.errors import OverdriveError
from overdrive.engine import Builder, BuildConfig, ShapeProfile

pytest.importorskip("onnxruntime")


class Recurrent(nn.Module):
    """x (B, T, 4) -> h (B, 4), one Python loop step per time step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.fc(h) + x[:, t])
        return h


def test_a_loop_over_a_dynamic_dim_is_refused_not_wrong() -> None:
    prof = [ShapeProfile("x", (1, 1, 4), (2, 8, 4), (4, 16, 4))]
    with pytest.raises(OverdriveError, match=r"static shape of 8 .*the model fixes a dim the shape profile lets vary"):
        Builder(BuildConfig(device="cpu", backend="onnxruntime", profiles=prof)).build(Recurrent().eval())


def test_the_same_model_with_only_its_batch_dynamic_builds_and_matches() -> None:
    """Reference: the fp32 module; tolerance 1e-5, at the profile's min, opt and max batch."""
    m = Recurrent().eval()
    prof = [ShapeProfile("x", (1, 8, 4), (2, 8, 4), (4, 8, 4))]
    eng = Builder(BuildConfig(device="cpu", backend="onnxruntime", profiles=prof)).build(m)
    g = torch.Generator().manual_seed(0)
    for b in (1, 2, 4):
        x = torch.randn(b, 8, 4, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(eng(x), m(x), atol=1e-5, rtol=1e-5)
