"""GPU checks (run on the H200): masks on CUDA, amp O2 fp16 with fused AdamW, cuSPARSELt export."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import amp
from overdrive.sparsity import compute_mask, from_pruned, is_2to4, sparsify

pytestmark = pytest.mark.gpu


def test_masks_match_cpu() -> None:
    w = torch.randn(64, 128)
    for calc in ("m4n2_1d", "m4n2_2d_greedy", "m4n2_2d_best"):
        assert torch.equal(compute_mask(w.cuda(), calc).cpu(), compute_mask(w, calc))


def test_amp_o2_fused_adamw_on_gpu() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).cuda()
    handle = sparsify(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle.attach(opt)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.float16))
    for _ in range(5):
        mp.backward(model(torch.randn(32, 64, device="cuda")).float().square().mean())
        mp.step()
        mp.zero_grad()
    for layer in handle.layers:
        assert layer.weight.dtype == torch.float16
        assert is_2to4(layer.weight) and is_2to4(layer.original)


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    sparsify(m)
    return m.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_export_forced_sparse_matches_dense(dtype: torch.dtype) -> None:
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("no sparse tensor cores")
    model = _mlp(dtype)
    x = torch.randn(2048, 1024, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = model(x).float()
        exp = copy.deepcopy(model)
        table = from_pruned(exp).export(tokens=2048, min_speedup=0.0)
        assert [r[-1] for r in table.rows] == ["sparse", "sparse"], table.rows
        assert isinstance(exp[0].weight, torch.sparse.SparseSemiStructuredTensor)
        out = exp(x).float()
    rel = float((out - ref).norm() / ref.norm())
    assert rel < 1e-2, rel


def test_export_keeps_dense_where_not_faster() -> None:
    model = _mlp(torch.float16)
    with torch.no_grad():
        table = from_pruned(model).export(tokens=1024, min_speedup=float("inf"))
    assert all(r[-1].startswith("dense") for r in table.rows)
    assert not isinstance(model[0].weight, torch.sparse.SparseSemiStructuredTensor)
    assert "never makes a layer slower" in table.notes[0]
