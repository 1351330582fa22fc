"""FusedNovoGrad checkpoints in apex's layout (the gradient norms as ``[fp16 norms, fp32 norms]`` lists in each
param group, only ``exp_avg`` per parameter) and in this package's own, fp16 parameters included."""

from __future__ import annotations

import copy

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.apex.optimizers import FusedNovoGrad


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g).half()),
            torch.nn.Parameter(torch.randn(3, generator=g))]


def _grads(step: int, params: list[torch.nn.Parameter], big: float = 1.0) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for q in params:
        q.grad = (big * torch.randn(q.shape, generator=g)).to(q.dtype)


def _run(opt: FusedNovoGrad, params: list[torch.nn.Parameter], steps: range) -> None:
    for t in steps:
        _grads(t, params)
        opt.step()


def _to_apex_layout(sd: dict, params: list[torch.nn.Parameter]) -> dict:
    """What apex's FusedNovoGrad.state_dict holds: exp_avg per parameter, the norms as lists in the group."""
    apex = {"state": {i: {"exp_avg": s["exp_avg"].clone()} for i, s in sd["state"].items()}, "param_groups": []}
    for group in sd["param_groups"]:
        group = {k: v for k, v in group.items() if k != "exp_avg_sq"}
        lists = []
        for dtype in (torch.float16, torch.float32):
            lists.append(torch.stack([sd["state"][i]["exp_avg_sq"].float().reshape(()) for i in group["params"]
                                      if params[i].dtype == dtype]))
        apex["param_groups"].append(dict(group, exp_avg_sq=lists))
    return apex


@pytest.mark.parametrize("init_zero", [False, True])
def test_apex_layout_checkpoint_resumes_exactly(init_zero: bool) -> None:
    ref = _params()
    ref_opt = FusedNovoGrad(ref, lr=0.01, weight_decay=0.001, init_zero=init_zero)
    _run(ref_opt, ref, range(5))

    half = _params()
    opt = FusedNovoGrad(half, lr=0.01, weight_decay=0.001, init_zero=init_zero)
    _run(opt, half, range(2))
    apex_sd = _to_apex_layout(copy.deepcopy(opt.state_dict()), half)
    resumed = [torch.nn.Parameter(q.detach().clone()) for q in half]
    opt2 = FusedNovoGrad(resumed, lr=0.01, weight_decay=0.001, init_zero=init_zero)
    opt2.load_state_dict(apex_sd)
    _run(opt2, resumed, range(2, 5))
    for a, b in zip(resumed, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_carries_apex_lists_and_fp32_norms_of_half_params() -> None:
    params = [torch.nn.Parameter(torch.ones(4).half()), torch.nn.Parameter(torch.ones(2))]
    opt = FusedNovoGrad(params, lr=0.01)
    for q in params:
        q.grad = torch.full(q.shape, 60000.0).to(q.dtype)  # fp16 grad norm 120000: past fp16's largest, 65504
    opt.step()
    sd = opt.state_dict()
    fp16_norms, fp32_norms = sd["param_groups"][0]["exp_avg_sq"]
    torch.testing.assert_close(fp16_norms, torch.tensor([120000.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(fp32_norms, torch.tensor([60000.0 * 2**0.5]), rtol=1e-6, atol=0)

    again = FusedNovoGrad(params, lr=0.01)
    again.load_state_dict(sd)
    norm = again.state[params[0]]["exp_avg_sq"]
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(120000.0, rel=1e-6)
    assert "exp_avg_sq" not in again.param_groups[0]


def test_apex_layout_with_wrong_count_names_the_mismatch() -> None:
    params = _params()
    opt = FusedNovoGrad(params, lr=0.01)
    _run(opt, params, range(1))
    apex_sd = _to_apex_layout(opt.state_dict(), params)
    apex_sd["param_groups"][0]["exp_avg_sq"][1] = torch.ones(5)
    with pytest.raises(UsageError, match="5 torch.float32 gradient norms.*number 2"):
        FusedNovoGrad(_params(), lr=0.01).load_state_dict(apex_sd)
