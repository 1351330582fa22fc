"""The demo's accuracy loop through a static-shape engine (the GPU demo builds its engines for one batch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from overdrive.demo.engine_stage import _accuracy


def _ctx(n: int) -> SimpleNamespace:
    torch.manual_seed(0)
    y = torch.randint(0, 3, (n,))
    x = torch.nn.functional.one_hot(y, 3).float().view(n, 3, 1, 1)  # the "model" reads the label off the image
    return SimpleNamespace(data=SimpleNamespace(x_test=x, y_test=y), device=torch.device("cpu"))


def _static(batch: int):  # noqa: ANN202 - like a static-profile engine: one batch size only
    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != batch:
            raise ValueError(f"batch {x.shape[0]} outside the profile")
        return x.flatten(1)
    return fn


def test_short_last_batch_is_padded_and_only_real_rows_scored() -> None:
    ctx = _ctx(10)  # batches of 4: 4, 4, then 2 real rows padded to 4
    assert _accuracy(_static(4), ctx, 4, pad=True) == 1.0
    wrong = _ctx(10)
    wrong.data.y_test[-1] = (wrong.data.y_test[-1] + 1) % 3  # a miss in the short batch counts once, padding never
    assert _accuracy(_static(4), wrong, 4, pad=True) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="outside the profile"):
        _accuracy(_static(4), ctx, 4)
