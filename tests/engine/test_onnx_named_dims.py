"""Input dims an ONNX model names alike (one ``dim_param``) have one size, as TensorRT 10's named dimensions:
a profile that gives them different ranges is refused at build, and a call with different sizes is refused by
name. Before, an onnxruntime engine broadcast x (2, 8) against y (1, 6) into a (2, 4) output with no error, and
failed deep in ONNX Runtime on (2, 8) against (3, 6)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, BuildConfig, ShapeProfile

pytest.importorskip("onnxruntime")


class TwoIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


def _onnx(axes: dict) -> tuple[nn.Module, bytes]:
    torch.manual_seed(0)
    m = TwoIn().eval()
    buf = io.BytesIO()
    torch.onnx.export(m, (torch.randn(3, 8), torch.randn(3, 6)), buf, dynamo=False, input_names=["x", "y"],
                      output_names=["out"], dynamic_axes=axes)
    return m, buf.getvalue()


def _profiles(bx: int, by: int) -> list[ShapeProfile]:
    return [ShapeProfile("x", (1, 8), (min(4, bx), 8), (bx, 8)), ShapeProfile("y", (1, 6), (min(4, by), 6), (by, 6))]


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_a_shared_batch_dim_is_checked_at_each_call(backend: str) -> None:
    m, model = _onnx({"x": {0: "B"}, "y": {0: "B"}, "out": {0: "B"}})
    eng = Builder(BuildConfig(device="cpu", backend=backend, profiles=_profiles(16, 16))).build(model)
    x, y = torch.randn(5, 8), torch.randn(5, 6)
    with torch.no_grad():  # reference: the fp32 module, tolerance 1e-5
        torch.testing.assert_close(eng(x, y), m(x, y), atol=1e-5, rtol=1e-5)
    for yb in (1, 3):
        with pytest.raises(UsageError, match=rf"inputs x\[0\]=2, y\[0\]={yb} must be equal"):
            eng(torch.randn(2, 8), torch.randn(yb, 6))


def test_a_profile_giving_a_shared_dim_two_ranges_is_refused() -> None:
    _, model = _onnx({"x": {0: "B"}, "y": {0: "B"}, "out": {0: "B"}})
    with pytest.raises(UsageError, match=r"x\[0\] 1/4/16, y\[0\] 1/1/1 .*share the ONNX model's dim 'B'"):
        Builder(BuildConfig(device="cpu", backend="onnxruntime", profiles=_profiles(16, 1))).build(model)


def test_dims_named_apart_stay_independent() -> None:
    """Different dim_params: no constraint is invented (y at batch 1 broadcasts, as in the module)."""
    m, model = _onnx({"x": {0: "Bx"}, "y": {0: "By"}, "out": {0: "Bx"}})
    eng = Builder(BuildConfig(device="cpu", backend="onnxruntime", profiles=_profiles(16, 1))).build(model)
    x, y = torch.randn(4, 8), torch.randn(1, 6)
    with torch.no_grad():
        torch.testing.assert_close(eng(x, y), m(x, y), atol=1e-5, rtol=1e-5)
