"""Engines from models that return their own ``@dataclass`` (unregistered with torch's pytree): torch.export and the
ONNX exporters refused them ("Found <class Out> in output, which is not a known type"). The engine returns such an
output as it returns a dict's: an ``EngineOutput`` by field name (``out.logits``), after a save and load too.
Reference: the model's own fields in fp32; tolerance 1e-5 (fp32 engines of a Linear)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive.engine.sources import _reproduces, from_module
from overdrive.engine.structured import dataclasses_as_dicts

pytest.importorskip("onnxruntime")


@dataclasses.dataclass
class Aux:
    hidden: torch.Tensor  # (B, 4)


@dataclasses.dataclass(frozen=True)
class Out:
    logits: torch.Tensor  # (B, 4) float
    labels: torch.Tensor  # (B,) int64
    aux: Aux
    loss: torch.Tensor | None = None  # no loss at inference: no engine output


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> Out:
        h = self.fc(x)
        return Out(h.softmax(-1), h.argmax(-1), Aux(h * 2))


def _check(out: object, ref: Out) -> None:
    assert list(out) == ["logits", "labels", "aux"]
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    assert out.labels.dtype == torch.int64 and torch.equal(out.labels, ref.labels)
    torch.testing.assert_close(out["aux"][0], ref.aux.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_engine_of_a_dataclass_output_returns_its_fields_by_name(backend: str, tmp_path) -> None:
    m = Head().eval()
    x = torch.randn(3, 8)
    engine = Builder(backend=backend).build(m, (x,))
    ref = m(x)
    _check(engine(x), ref)
    assert [o["name"] for o in engine.header["outputs"]] == ["logits", "labels", "aux.0"]
    engine.save(tmp_path / "head.engine")
    _check(Engine.load(tmp_path / "head.engine")(x), ref)
    assert isinstance(m(x), Out) and not m._forward_hooks  # the build leaves the user's model as it was


def test_dynamic_onnx_build_checks_a_dataclass_output() -> None:
    m = Head().eval()
    prof = [ShapeProfile("x", (1, 8), (3, 8), (6, 8))]
    engine = Builder(backend="onnxruntime", profiles=prof).build(m, (torch.randn(3, 8),))
    x = torch.randn(5, 8)
    _check(engine(x), m(x))


def test_onnx_export_check_reads_dataclass_fields() -> None:
    """The check of a dynamic ONNX export against the model read a dataclass output as no tensors and refused an
    export that is right."""

    class AsDict(nn.Module):
        def __init__(self, head: Head) -> None:
            super().__init__()
            self.head = head

        def forward(self, x: torch.Tensor) -> dict:
            return dataclasses_as_dicts(self.head(x))

    m = Head().eval()
    prof = [ShapeProfile("x", (1, 8), (3, 8), (6, 8))]
    data = from_module(AsDict(m)).as_onnx((torch.randn(3, 8),), prof)
    assert _reproduces(data, m, (torch.randn(3, 8),), prof, ["x"])


def test_dataclasses_as_dicts_keeps_other_outputs() -> None:
    t = torch.zeros(1)
    for out in (t, (t, [t]), {"a": t, "b": None}):
        assert dataclasses_as_dicts(out) is out
    got = dataclasses_as_dicts((Aux(t), {"k": Aux(t)}))
    assert got == ({"hidden": t}, {"k": {"hidden": t}})


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor  # (B, 8) float
    mask: torch.Tensor  # (B, 4) 0/1
    scale: float = 1.0  # not a tensor: every engine call keeps the example's


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)

    def forward(self, batch: Batch, bias: torch.Tensor) -> Out:
        h = self.fc(batch.x) * batch.mask * batch.scale + bias
        return Out(h, h.argmax(-1), Aux(h))


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_engine_of_a_model_taking_a_dataclass_takes_its_fields(backend: str) -> None:
    """``build(model, (Batch(x, mask), bias))`` was refused ("example input 0 is a Batch")."""
    m = Masked().eval()
    b, bias = Batch(torch.randn(3, 8), (torch.rand(3, 4) > 0.5).float(), 2.0), torch.randn(4)
    engine = Builder(backend=backend).build(m, (b, bias))
    assert engine.input_names == ["x", "mask", "bias"]
    b2 = Batch(torch.randn(3, 8), torch.ones(3, 4), 2.0)
    _check(engine(b2.x, b2.mask, bias), m(b2, bias))
    _check(engine(x=b.x, mask=b.mask, bias=bias), m(b, bias))
    _check(engine(b2, bias), m(b2, bias))  # the dataclass itself, as the model takes it
    assert not m._forward_pre_hooks and not m._forward_hooks


def test_dataclass_calibration_batches_and_bad_forms() -> None:
    m = Masked().eval()
    batches = [(Batch(torch.randn(3, 8), torch.ones(3, 4)), torch.zeros(3, 4)) for _ in range(2)]
    engine = Builder(backend="onnxruntime", precision="int8").build(m, batches[0], calib=batches)
    assert engine.header["accuracy"]["passed"] is not False
    with pytest.raises(UsageError, match="calibration batch 1 is a Batch holding 2 tensor"):
        Builder(backend="onnxruntime").build(m, batches[0], calib=[batches[0], batches[0][0]])
    with pytest.raises(UsageError, match="input_names \\['a'\\] name 1 inputs"):
        Builder(backend="onnxruntime").build(m, batches[0], input_names=["a"])
