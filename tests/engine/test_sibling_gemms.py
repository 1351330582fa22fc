"""Sibling GEMMs as one (engine/sibling_gemms.py): Linears reading one input become one linear on the concatenated
weights plus a split; the rest stay. Reference: the eager module, fp32 on CPU, within 1e-5 (one GEMM on the
concatenated weight computes the same dot products)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive._utils.errors import UsageError
from overdrive.engine.sibling_gemms import TimedGroups, fuse_sibling_gemms

LIN = torch.ops.aten.linear.default


class Attention(nn.Module):
    """Q/K/V of one input (K narrower, as grouped-query attention), a gate/up pair without bias, and a Linear of
    another input, which stays alone."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d, d)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = self.out(q * v) + k.repeat(1, 1, 2)
        return torch.relu(self.gate(h)) * self.up(h), v  # v is also an output of the program


def _export(m: nn.Module, x: torch.Tensor, dynamic=None):
    with torch.no_grad():
        return torch.export.export(m, (x,), dynamic_shapes=dynamic, strict=False)


@pytest.mark.parametrize("dynamic", [False, True])
def test_groups_fuse_and_match_eager(tmp_path: Path, dynamic: bool) -> None:
    torch.manual_seed(0)
    m, x = Attention().eval(), torch.randn(2, 5, 16)
    ep = _export(m, x, ({0: torch.export.Dim("b", min=1, max=8)},) if dynamic else None)
    groups = fuse_sibling_gemms(ep)
    assert sorted(len(g) for g in groups) == [2, 3]  # q/k/v and gate/up; `out` reads another input
    assert [n.target for n in ep.graph.nodes].count(LIN) == 3
    path = tmp_path / "ep.pt2"
    torch.export.save(ep, path)
    reloaded = torch.export.load(path).module()
    with torch.no_grad():
        for xb in ([x, torch.randn(7, 5, 16)] if dynamic else [x]):
            for a, b in zip(reloaded(xb), m(xb)):
                assert (a - b).abs().max().item() <= 1e-5


class Mixed(nn.Module):
    """Siblings that cannot share a GEMM: in-features differ (a view of x), bias on one only, a non-parameter weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + torch.nn.functional.linear(x, w)


def test_unshareable_siblings_stay() -> None:
    m, x, w = Mixed().eval(), torch.randn(3, 8), torch.randn(4, 8)
    with torch.no_grad():
        ep = torch.export.export(m, (x, w), strict=False)
    assert fuse_sibling_gemms(ep) == []


def test_decide_can_veto_and_dynamic_shapes_are_not_timed() -> None:
    m, x = Attention().eval(), torch.randn(2, 5, 16)
    seen = []
    ep = _export(m, x)
    assert fuse_sibling_gemms(ep, lambda xv, outs, bias: seen.append((tuple(xv.shape), outs, bias)) or False) == []
    assert sorted(seen) == [((2, 5, 16), [16, 8, 16], True), ((2, 5, 16), [32, 32], False)]
    ep = _export(m, x, ({0: torch.export.Dim("b", min=1, max=8)},))
    timer = TimedGroups(torch.device("cpu"))
    assert fuse_sibling_gemms(ep, timer) == [] and timer.verdicts == {}  # no one shape: left separate, untimed


def test_engine_option(tmp_path: Path) -> None:
    from overdrive.engine.backends.inductor import use_sibling_gemms
    from overdrive.engine.config import BuildConfig

    assert use_sibling_gemms(BuildConfig(), torch.device("cpu"), True) is False
    assert use_sibling_gemms(BuildConfig(sibling_gemms=True), torch.device("cuda"), False) is False  # needs freezing
    torch.manual_seed(0)
    m, x = Attention().eval(), torch.randn(2, 5, 16)
    eng = Builder(precision="fp32", device="cpu", sibling_gemms=True, freezing=True,
                  profiles=[ShapeProfile.fixed("x", (2, 5, 16))]).build(m, (x,), input_names=["x"])
    assert eng.info["backend"] == "inductor" and eng.header["backend_meta"]["sibling_gemms_fused"] == 2
    with torch.no_grad():
        ref = m(x)
    for a, b in zip(eng(x), ref):
        assert (a - b).abs().max().item() <= 1e-5
    with pytest.raises(UsageError, match="--sibling-gemms rewrites the PyTorch graph"):
        Builder(precision="fp32", device="cpu", backend="onnxruntime", sibling_gemms=True).build(m, (x,), input_names=["x"])
