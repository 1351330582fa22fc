"""``compare`` / ``overdrive compare`` feeds each side its inputs by name and refuses sides that take different
inputs: an ONNX model whose inputs are ordered y, x got the engine's x, y by position, and an ONNX model of one
input was fed the first of two and its outputs compared with unrelated ones (FAILED with made-up numbers)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, BuildConfig, ShapeProfile, compare

pytest.importorskip("onnxruntime")


class TwoIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(y)


class Swapped(nn.Module):
    """The same function with its inputs in the other order: forward(y, x)."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.m(x, y)


def _onnx(m: nn.Module, example: tuple, names: list[str]) -> bytes:
    buf = io.BytesIO()
    torch.onnx.export(m, example, buf, dynamo=False, input_names=names, output_names=["out"],
                      dynamic_axes={n: {0: "B"} for n in names})
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine_and_model() -> tuple:
    m = TwoIn().eval()
    prof = [ShapeProfile("x", (1, 8), (4, 8), (8, 8)), ShapeProfile("y", (1, 6), (4, 6), (8, 6))]
    return Builder(BuildConfig(device="cpu", backend="onnxruntime", profiles=prof)).build(m), m


def test_an_onnx_model_with_its_inputs_in_another_order_is_fed_by_name(engine_and_model: tuple) -> None:
    """Reference: the same fp32 function; tolerance 1e-5 either way round (it raised a shape error, or with equal
    shapes compared the function of swapped inputs)."""
    eng, m = engine_and_model
    swapped = _onnx(Swapped(m), (torch.randn(3, 6), torch.randn(3, 8)), ["y", "x"])
    for a, b in ((eng, swapped), (swapped, eng)):
        r = compare(a, b, atol=1e-5, rtol=1e-5)
        assert r["passed"], r


def test_sides_that_take_other_inputs_are_refused_by_name(engine_and_model: tuple) -> None:
    eng, _ = engine_and_model
    one = _onnx(nn.Linear(8, 4).eval(), (torch.randn(3, 8),), ["x"])
    for a, b in ((eng, one), (one, eng)):
        with pytest.raises(UsageError, match=r"takes 1 input\(s\) \['x'\], but the other side takes 2"):
            compare(a, b)
    with pytest.raises(UsageError, match=r"pytorch\(Linear\) cannot take the 2 input\(s\) of the other side"):
        compare(eng, nn.Linear(8, 4).eval())


def test_a_pytorch_model_is_fed_by_its_forward_names() -> None:
    """An ONNX model declaring its inputs (y, x) against PyTorch models taking (x, y) and (y, x): both the same
    function, both PASS within 1e-5; and a different function of the same inputs FAILS. Before, the PyTorch side
    got the ONNX order by position: a false PASS for the different function, a false FAIL for the same one."""
    m = TwoIn().eval()
    onnx_yx = _onnx(Swapped(m), (torch.randn(3, 6), torch.randn(3, 8)), ["y", "x"])
    shapes = {"x": (3, 8), "y": (3, 6)}
    assert compare(onnx_yx, m, atol=1e-5, rtol=1e-5, shapes=shapes)["passed"]
    assert compare(onnx_yx, Swapped(m), atol=1e-5, rtol=1e-5, shapes=shapes)["passed"]

    class Other(nn.Module):  # another function of the same (x, y)
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return 2 * x + y

    class Same(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + 2 * y

    class SameYX(nn.Module):
        def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return x + 2 * y

    onnx_same = _onnx(SameYX(), (torch.randn(3, 4), torch.randn(3, 4)), ["y", "x"])
    shapes = {"x": (3, 4), "y": (3, 4)}
    assert compare(onnx_same, Same(), atol=1e-5, rtol=1e-5, shapes=shapes)["passed"]
    assert not compare(onnx_same, Other(), atol=1e-5, rtol=1e-5, shapes=shapes)["passed"]
