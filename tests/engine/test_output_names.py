"""A PyTorch model that returns a dict (or a Hugging Face ModelOutput) gives the engine's outputs its keys as names:
in the header, exec --exportOutput and compare (they were output0, output1: the keys were lost). Values and order
are unchanged (reference: the model's own dict, its values in key order). And a binding's dtype refusal that would
have advised a truncating cast."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from overdrive.engine import Builder, BuildConfig, ShapeProfile


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"logits": h, "probs": torch.softmax(h, -1)}


@pytest.mark.parametrize("backend", ["inductor", "onnxruntime"])
def test_dict_outputs_are_named_by_their_keys(backend: str) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = _DictOut().eval()
    cfg = BuildConfig(backend=backend, profiles=(ShapeProfile.fixed("x", (4, 16)),))
    eng = Builder(cfg).build(model, (torch.randn(4, 16),), input_names=["x"])
    assert [o["name"] for o in eng.header["outputs"]] == ["logits", "probs"]
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = model(x)
    got = eng(x)
    torch.testing.assert_close(got[0], want["logits"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want["probs"], rtol=1e-4, atol=1e-5)
    assert not model._forward_hooks  # the build's hook is gone from the user's model


class _NestedOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.a(x)
        return {"loss": None, "logits": h, "hidden_states": (x, h.relu())}


@pytest.mark.parametrize("backend", ["inductor", "onnxruntime"])
def test_a_dict_model_s_engine_returns_its_outputs_by_key(backend: str, tmp_path) -> None:
    # code written for the model (out["logits"], out.logits, out[0], out.hidden_states[1]) runs on its engine, also
    # after a save and load; reference: the model's own dict
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    from overdrive.engine import Engine

    torch.manual_seed(0)
    model = _NestedOut().eval()
    cfg = BuildConfig(backend=backend, profiles=(ShapeProfile.fixed("x", (4, 16)),))
    eng = Builder(cfg).build(model, (torch.randn(4, 16),), input_names=["x"])
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = model(x)
    eng.save(tmp_path / "m.engine")
    for e in (eng, Engine.load(tmp_path / "m.engine")):
        got = e(x)
        assert list(got) == ["logits", "hidden_states"]  # the key without a tensor (loss=None) is left out
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)
        assert got.logits is got["logits"] and got[0] is got["logits"]
        assert isinstance(got.hidden_states, tuple) and len(got.hidden_states) == 2
        torch.testing.assert_close(got.hidden_states[1], want["hidden_states"][1], rtol=1e-4, atol=1e-5)
        with pytest.raises(AttributeError, match="no 'pooler_output'; its keys are"):
            got.pooler_output


def test_a_hugging_face_model_output_comes_back_by_key() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg_bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, vocab_size=100)
    model = transformers.BertModel(cfg_bert).eval()
    ids = torch.randint(0, 100, (2, 8))
    eng = Builder(BuildConfig(backend="inductor")).build(model, (ids,), input_names=["input_ids"])
    with torch.no_grad():
        want = model(ids)
    got = eng(ids)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["pooler_output"], want.pooler_output, rtol=1e-4, atol=1e-4)


def test_tuple_outputs_keep_numbered_names() -> None:
    from overdrive.engine.api import output_keys

    assert output_keys((torch.zeros(1), torch.zeros(1))) == []
    assert output_keys({"a": torch.zeros(1), "b": None, "c": [torch.zeros(1)]}) == ["a", "c.0"]


def test_a_fractional_float_mask_for_an_integer_binding_is_not_told_to_cast() -> None:
    # an input named attention_mask is bound int64 when no example says otherwise; the refusal advised .to(int64),
    # which truncates an additive float mask (-0.5 -> 0) into wrong numbers
    from overdrive._utils.errors import UsageError

    class AddMask(nn.Module):
        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return x + attention_mask

    cfg = BuildConfig(profiles=(ShapeProfile.fixed("x", (2, 8)), ShapeProfile.fixed("attention_mask", (2, 8))))
    eng = Builder(cfg).build(AddMask(), None, input_names=["x", "attention_mask"])
    assert eng.input_dtypes[1] == torch.int64
    with pytest.raises(UsageError, match="holds fractional torch.float32 values .* casting would truncate them"):
        eng(torch.zeros(2, 8), torch.full((2, 8), -0.5))
    with pytest.raises(UsageError, match=r"pass it as torch.int64 \(x.to\(torch.int64\)"):  # whole numbers: castable
        eng(torch.zeros(2, 8), torch.ones(2, 8))
