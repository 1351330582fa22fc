"""A PyTorch model that returns a dict (or a Hugging Face ModelOutput) gives the engine's outputs its keys as names:
in the header, exec --exportOutput and compare (they were output0, output1: the keys were lost). Values and order
are unchanged (reference: the model's own dict, its values in key order)."""

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


def test_tuple_outputs_keep_numbered_names() -> None:
    from overdrive.engine.api import output_keys

    assert output_keys((torch.zeros(1), torch.zeros(1))) == []
    assert output_keys({"a": torch.zeros(1), "b": None, "c": [torch.zeros(1)]}) == ["a", "c.0"]
