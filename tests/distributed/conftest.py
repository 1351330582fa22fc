"""Shared fixtures for the distributed tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from overdrive import distributed as odist


@pytest.fixture
def group() -> Iterator[None]:
    """A process group of one in this process (what DCP expects), destroyed afterwards."""
    odist.init(backend="gloo", device="cpu")
    try:
        yield
    finally:
        dist.destroy_process_group()
