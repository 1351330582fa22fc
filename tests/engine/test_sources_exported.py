"""``torch.export`` archives with several inputs (``overdrive build --exported``): torch.export's module refuses
train()/eval() and keyword calls, which the ONNX exporters and the by-name wrapper made, so a two-input archive
failed to build on the onnxruntime backend (CPU's default) with ``NotImplementedError: Calling train() is not
supported yet``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine import Builder, BuildConfig, Engine

pytest.importorskip("onnxruntime")


class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.bn(self.a(x) + self.b(y))
        return s.relu(), (self.a(x) * 2).sum(-1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = TwoInTwoOut()
    with torch.no_grad():  # eval statistics far from training ones: a training-mode graph would show
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_two_input_archive_builds_and_matches_the_module(tmp_path: Path, backend: str) -> None:
    """Reference: the fp32 module the archive was exported from; tolerance 1e-5."""
    m = _model()
    x, y = torch.randn(3, 8), torch.randn(3, 6)
    torch.export.save(torch.export.export(m, (x, y)), tmp_path / "m.pt2")
    eng = tmp_path / "m.engine"
    assert main(["build", "--exported", str(tmp_path / "m.pt2"), "--backend", backend, "--device", "cpu",
                 "--save-engine", str(eng)]) == 0
    e = Engine.load(str(eng))
    assert e.input_names == ["x", "y"]
    with torch.no_grad():
        ref = m(x, y)
    for got, want in zip(e.run(x, y), ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_missing_shapes_hint_names_every_onnx_input_with_its_dims() -> None:
    """No shapes for a dynamic ONNX model: the hint gives each input its own rank and fixed dims (it said
    ``x:1x3x224x224`` for any model, which this one refuses)."""
    m = _model()
    import io

    buf = io.BytesIO()
    torch.onnx.export(m, (torch.randn(3, 8), torch.randn(3, 6)), buf, dynamo=False, input_names=["x", "y"],
                      dynamic_axes={"x": {0: "B"}, "y": {0: "B"}})
    with pytest.raises(UsageError, match=r"--shapes x:1x8,y:1x6 "):
        Builder(BuildConfig(device="cpu")).build(buf.getvalue())
