"""Shared fixtures for the distributed tests."""

from __future__ import annotations

import gc
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
        gc.collect()  # DDP reducers of the test go before their process group (gloo's teardown hung after it)
        dist.destroy_process_group()
