"""Shared test set-up: deterministic seeds, and `gpu` tests skipped where no CUDA GPU is present."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _signing_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Engines and timing caches are signed with a key made for the test session (never the user's own,
    in ~/.config); subprocesses inherit it through the environment."""
    os.environ.pop("OVERDRIVE_SIGNING_KEY", None)
    os.environ["OVERDRIVE_SIGNING_KEY_FILE"] = str(tmp_path_factory.mktemp("signing") / "signing.key")
