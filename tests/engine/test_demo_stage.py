"""The demo's engine stage on CPU: fp32 engine accuracy equals PyTorch's on the digits test set."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")


def test_engine_stage(digits: torch.nn.Module) -> None:
    from overdrive.demo.context import DemoContext
    from overdrive.demo.data import load_digits
    from overdrive.demo.engine_stage import run

    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=load_digits(seed=0), progress=False)
    ctx.fp32_model = digits
    with torch.no_grad():
        ref_acc = float((digits(ctx.digits.x_test).argmax(1) == ctx.digits.y_test).float().mean())
    ctx.fp32_accuracy = ref_acc
    table = run(ctx)
    row = dict(zip(table.columns, table.rows[0]))
    assert row["precision"] == "fp32" and row["compare"] == "PASSED"
    assert abs(row["accuracy"] - ref_acc) < 1e-6 and row["max err"] < 1e-4
    assert "engine_fp32" in ctx.artifacts
