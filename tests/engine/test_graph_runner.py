"""GraphRunner's fallback: a program that cannot be recorded as one CUDA graph warns once and runs as it is (here:
no CUDA at all, the same path a capture failure takes on a GPU). Reference: the function's own result, exactly."""

from __future__ import annotations

import warnings

import pytest
import torch

from overdrive.engine.backends.inductor import GraphRunner
from overdrive.engine.fp32_flags import fp32_flags


def test_unrecordable_program_warns_once_then_runs_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    r = GraphRunner(fn, fp32_flags("fp32"), "torch.compile")
    with pytest.warns(RuntimeWarning, match="could not be recorded as one CUDA graph"):
        first = r(torch.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        second = r(torch.full((5,), 3.0))  # and no shape check: nothing was recorded
    assert torch.equal(first[0], torch.full((3,), 2.0)) and torch.equal(second[0], torch.full((5,), 6.0))
    assert r.ungraphed and r.via == "torch.compile, no CUDA graph" and len(calls) == 2
