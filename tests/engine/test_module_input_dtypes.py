"""A PyTorch model built from shape profiles alone (``overdrive build --model pkg:factory --shapes ...``, or
``Builder(BuildConfig(profiles=...)).build(module)``): an input that indexes an embedding or gather is made int64
and one used as a mask bool, from the forward's torch.fx graph (they were random floats and the export failed).
Outputs against eager fp32 on the same integer/bool inputs, tolerance 1e-5."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.engine import Builder, BuildConfig, ShapeProfile
from overdrive.engine.sources import from_module, with_forward_dtypes

pytest.importorskip("onnxruntime")


class BagMask(nn.Module):
    """ids (B, L) -> embedding bag; x (B, L, D) masked by mask (B, L) bool; top (B, K) indices gathered."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(30, 8, mode="sum")
        self.proj = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        h = self.bag(ids.reshape(ids.shape[0], -1)) + x.masked_fill(~mask.unsqueeze(-1), 0.0).sum(1)  # (B, D)
        return torch.gather(self.proj(h), 1, top)  # (B, K)


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens).mean(1)


def test_dtypes_from_the_forward() -> None:
    assert with_forward_dtypes(from_module(BagMask())).input_dtypes == {"ids": torch.int64, "mask": torch.bool,
                                                                         "top": torch.int64}


def test_a_build_given_example_inputs_does_not_trace_the_forward() -> None:
    """Tracing runs forward on torch.fx proxies (a forward that stores a tensor on the module would keep a proxy);
    only builds that make their inputs from shapes need it."""
    seen: list[str] = []

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(type(x).__name__)
            return self.lin(x)

    src = from_module(Recorder())
    assert src.input_dtypes == {} and seen == []
    Builder(BuildConfig(device="cpu", backend="onnxruntime")).build(Recorder().eval(), (torch.randn(2, 4),))
    assert "Proxy" not in seen


def test_build_from_profiles_matches_eager() -> None:
    model = BagMask().eval()
    profiles = [ShapeProfile.fixed("ids", (2, 5)), ShapeProfile.fixed("x", (2, 5, 8)), ShapeProfile.fixed("mask", (2, 5)),
                ShapeProfile.fixed("top", (2, 3))]
    eng = Builder(BuildConfig(device="cpu", backend="onnxruntime", profiles=profiles)).build(model)
    assert [str(d) for d in eng.input_dtypes] == ["torch.int64", "torch.float32", "torch.bool", "torch.int64"]
    g = torch.Generator().manual_seed(1)
    xs = (torch.randint(0, 30, (2, 5), generator=g), torch.randn(2, 5, 8, generator=g),
          torch.tensor([[True] * 5, [True, False, True, False, False]]), torch.randint(0, 4, (2, 3), generator=g))
    with torch.no_grad():
        torch.testing.assert_close(eng(*xs), model(*xs), atol=1e-5, rtol=1e-5)


def test_one_input_renamed_by_the_profile_keeps_its_dtype() -> None:
    """--shapes input:2x7 for forward(tokens): the input takes the profile's name and stays int64."""
    model = Lookup().eval()
    eng = Builder(BuildConfig(device="cpu", backend="onnxruntime", profiles=[ShapeProfile.fixed("input", (2, 7))])).build(model)
    assert eng.input_names == ["input"] and eng.input_dtypes == [torch.int64]
    ids = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(eng(ids), model(ids), atol=1e-5, rtol=1e-5)


class TableIndex(nn.Module):
    """x (B, T, 8) plus rows of a parameter table picked by idx (B, T), and columns picked by cols (K,)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(50, 8))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return (x + self.table[idx])[:, :, cols]


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_a_tensor_index_input_is_int64(backend: str) -> None:
    """``table[idx]`` and ``x[:, :, cols]``: the index inputs are int64 (they were float, and the export failed with
    'tensors used as indices must be long'); outputs against eager fp32, tolerance 1e-5, at the profile's min and max."""
    m = TableIndex().eval()
    assert module_dtypes(m) == {"idx": torch.int64, "cols": torch.int64}
    prof = [ShapeProfile("x", (1, 1, 8), (2, 5, 8), (4, 10, 8)), ShapeProfile("idx", (1, 1), (2, 5), (4, 10)),
            ShapeProfile("cols", (3,), (3,), (3,))]
    eng = Builder(BuildConfig(device="cpu", backend=backend, profiles=prof)).build(m)
    g = torch.Generator().manual_seed(0)
    for b, t in ((1, 1), (4, 10)):
        x, idx, cols = torch.randn(b, t, 8, generator=g), torch.randint(0, 50, (b, t), generator=g), torch.tensor([7, 0, 3])
        with torch.no_grad():
            torch.testing.assert_close(eng(x, idx, cols), m(x, idx, cols), atol=1e-5, rtol=1e-5)


def module_dtypes(m: nn.Module) -> dict[str, torch.dtype]:
    return with_forward_dtypes(from_module(m)).input_dtypes
