"""Checks every config test shares."""

from __future__ import annotations

import dataclasses

import pytest


def assert_frozen(cfg: object) -> None:
    """No field of ``cfg`` can be assigned, and none is a mutable container a caller could change in place."""
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, f.name, getattr(cfg, f.name))
        assert not isinstance(getattr(cfg, f.name), (list, dict, set)), f.name
