"""The loader's default worker count is 4 capped at the usable cores: 4 workers on 2 cores made torch's
DataLoader warn about its own defaults ("suggested max number of worker in current system is 2")."""

from __future__ import annotations

import os

import pytest

from overdrive.data import LoaderConfig
from overdrive.data.config import default_workers


@pytest.mark.parametrize("cores,expected", [(1, 1), (2, 2), (4, 4), (64, 4)])
def test_default_workers_are_capped_at_the_usable_cores(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                        expected: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_workers() == expected
    assert LoaderConfig().num_workers == expected
    assert LoaderConfig(num_workers=8).num_workers == 8  # what the user asks for is kept
