"""Builds whose example inputs are a dict by name, as Hugging Face models are called (``model(**batch)``), with
calibration batches as dicts (what a DataLoader over a tokenized dataset yields). The reference is the eager
model called with the same keywords (fp32 engines: within 1e-5; int8 within cosine 0.99)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, BuildConfig
from overdrive.engine.inputs import build_inputs

ORT = BuildConfig(backend="onnxruntime")


class Keywords(nn.Module):
    """Inputs that are not forward's first positional parameters: only a keyword call reaches them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                y: torch.Tensor | None = None, emb: torch.Tensor | None = None) -> torch.Tensor:
        out = self.b(emb) if emb is not None else self.a(x)
        return out if y is None else out + self.b(y)


def test_dict_example_names_the_inputs_and_calls_by_keyword() -> None:
    m = Keywords().eval()
    x, y = torch.randn(3, 8), torch.randn(3, 6)
    eng = Builder(ORT).build(m, {"x": x, "y": y})  # y is forward's third parameter, not its second
    assert eng.input_names == ["x", "y"]
    with torch.no_grad():
        torch.testing.assert_close(eng(x=x, y=y), m(x=x, y=y), rtol=1e-5, atol=1e-5)


def test_one_keyword_input_that_is_not_the_first_parameter() -> None:
    m = Keywords().eval()
    e = torch.randn(2, 6)
    eng = Builder(ORT).build(m, {"emb": e})  # a positional call would have given it to x (a shape error)
    with torch.no_grad():
        torch.testing.assert_close(eng(e), m(emb=e), rtol=1e-5, atol=1e-5)


def test_encoder_decoder_from_a_dict() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    m = transformers.T5Model(cfg).eval()
    batch = {"input_ids": torch.randint(0, 100, (2, 7)), "decoder_input_ids": torch.randint(0, 100, (2, 5))}
    eng = Builder(ORT).build(m, batch)
    with torch.no_grad():
        ref = m(**batch).last_hidden_state
    torch.testing.assert_close(eng(**batch)["last_hidden_state"], ref, rtol=1e-5, atol=1e-5)


def test_int8_calibrated_on_dict_batches_with_extra_keys() -> None:
    m = Keywords().eval()
    g = torch.Generator().manual_seed(1)
    calib = [{"x": torch.randn(3, 8, generator=g), "y": torch.randn(3, 6, generator=g), "labels": torch.ones(3)}
             for _ in range(4)]
    eng = Builder(BuildConfig(precision="int8", backend="onnxruntime", int8_activations="static")).build(
        m, {"x": calib[0]["x"], "y": calib[0]["y"]}, calib=calib)
    x, y = calib[1]["x"], calib[1]["y"]
    with torch.no_grad():
        cos = torch.nn.functional.cosine_similarity(eng(x=x, y=y).flatten(), m(x=x, y=y).flatten(), dim=0)
    assert cos > 0.99
    acc = eng.header["accuracy"]  # the build's own check calls the float model by keyword too (it called m(x, y):
    assert acc["passed"] is True and acc["cosine"] > 0.99, acc  # y went to mask, and a good engine read cosine 0.5)


@pytest.mark.parametrize("example, calib, match", [
    ({"x": torch.zeros(1, 8), "mask": None}, None, "'mask' is a NoneType"),
    ({}, None, "empty dict"),
    ({"x": torch.zeros(1, 8)}, {"x": torch.zeros(1, 8)}, "calib is one batch"),
    ({"x": torch.zeros(1, 8)}, [{"input": torch.zeros(1, 8)}], "batch 0 has no 'x'"),
    ((torch.zeros(1, 8),), [{"x": torch.zeros(1, 8)}], "inputs are not named"),
    ("x", None, "example inputs of type str"),
])
def test_bad_inputs_are_named(example: object, calib: object, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        Builder(ORT).build(Keywords().eval(), example, calib=calib)


def test_input_names_must_agree_with_the_keys() -> None:
    with pytest.raises(UsageError, match=r"input_names \['y'\] differ from the example dict's keys \['x'\]"):
        build_inputs({"x": torch.zeros(1)}, ["y"], None)
