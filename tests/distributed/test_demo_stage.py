"""The demo's distributed stage on CPU: one process, then DDP and FSDP2 on 2 gloo ranks under torchrun.
Reference: DDP's weights. FSDP2 must match them to 1e-5; all three runs must reach a sensible accuracy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")


def test_distributed_stage() -> None:
    from overdrive.demo.context import DemoContext
    from overdrive.recipes.data import load_digits
    from overdrive.demo.distributed_stage import run

    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=load_digits(seed=0), progress=False)
    table = run(ctx)
    rows = {r[0]: dict(zip(table.columns, r)) for r in table.rows}
    assert set(rows) == {"none (1 process)", "ddp", "fsdp"} and "(gloo)" in table.title
    assert rows["ddp"]["ranks"] == rows["fsdp"]["ranks"] == 2
    assert float(rows["ddp"]["max |w - w_ddp|"]) == 0.0 and float(rows["fsdp"]["max |w - w_ddp|"]) <= 1e-5
    assert all(r["test accuracy"] > 0.9 for r in rows.values())
    assert abs(rows["fsdp"]["final loss"] - rows["ddp"]["final loss"]) <= 1e-5
    assert any("overdrive doctor" in n for n in table.notes)
