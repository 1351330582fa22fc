"""The demo's engine stage on CPU: fp32 engine accuracy equals PyTorch's on the digits test set."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")


def test_engine_stage(digits: torch.nn.Module) -> None:
    from overdrive.demo.context import DemoContext
    from overdrive.recipes.data import load_digits
    from overdrive.demo.engine_stage import run

    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=load_digits(seed=0), progress=False)
    ctx.fp32_model = digits
    with torch.no_grad():
        ref_acc = float((digits(ctx.digits.x_test).argmax(1) == ctx.digits.y_test).float().mean())
    ctx.fp32_accuracy = ref_acc
    table = run(ctx)
    rows = {r[0]: dict(zip(table.columns, r)) for r in table.rows}
    row = rows["engine fp32"]
    assert row["compare"] == "PASSED"
    assert abs(row["test accuracy"] - ref_acc) < 1e-6 and row["max err"] < 1e-4
    assert "engine_fp32" in ctx.artifacts
    # the plain-PyTorch baselines of the same run, and every speed-up ratio recorded against them
    eager, comp = rows["PyTorch eager fp32"], rows["torch.compile(mode='default')"]
    assert abs(eager["test accuracy"] - ref_acc) < 1e-6 and abs(comp["test accuracy"] - ref_acc) < 1e-6
    assert row["vs eager"] == row["img/s"] / eager["img/s"]
    for r in (row, eager, comp):  # the middle half of the timed calls, around the median
        lo, hi = (float(v.replace(",", "")) for v in r["img/s IQR"].split("-"))
        # the bounds are printed as whole img/s: up to 0.5 off each way (229 for a quartile at 228.6)
        assert lo - 0.5 <= r["img/s"] * 1.0001 and r["img/s"] <= (hi + 0.5) * 1.0001
    labels = {(s["label"], s["baseline"]) for s in table.speedups}
    assert ("engine fp32", "PyTorch eager fp32") in labels and ("engine fp32", "torch.compile") in labels
