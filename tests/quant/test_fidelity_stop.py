"""The extra fidelity pass of a config whose calibration runs no batch stops after MAX_BATCHES calls, also when the
user's forward loop catches Exception around each batch (a common guard against bad samples): it ran every batch."""

from __future__ import annotations

import torch
from torch import nn

from overdrive.quant import fidelity


def test_a_guarded_forward_loop_still_stops_early() -> None:
    model = nn.Linear(4, 2)
    calls = []

    def loop(m: nn.Module) -> None:
        for _ in range(50):
            try:
                m(torch.randn(3, 4))
                calls.append(1)
            except Exception:  # noqa: BLE001 - the user's guard
                calls.append(0)

    fidelity.run_until_captured(model, loop)
    assert len(calls) < 50 and len(calls) <= fidelity.MAX_BATCHES
