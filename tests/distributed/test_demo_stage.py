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


def test_cpu_ranks_share_the_cores_evenly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each gloo rank gets cores // ranks threads and the single process all of them (it got torch's default
    and the ranks 1, which made 2-rank DDP look 5.5x faster on 2 cores); samples/s is a median over epochs with
    its spread. torchrun is replaced by a stand-in that records the environment it would get."""
    import json

    import overdrive.data.config as data_config
    import overdrive.distributed.launch as dl
    from overdrive.demo.context import DemoContext
    from overdrive.demo.distributed_stage import run
    from overdrive.recipes.data import load_digits

    seen: dict = {}
    monkeypatch.setattr(data_config, "usable_cpus", lambda: 4)
    monkeypatch.setattr("overdrive.demo.distributed_stage.EPOCHS", 1)

    def fake_launch(cfg, script, args, module=False, env=None, timeout_s=None, check=True):  # type: ignore[no-untyped-def]
        from overdrive.recipes.models import DigitsCNN

        seen["omp"], seen["threads_in_process"] = env["OMP_NUM_THREADS"], torch.get_num_threads()
        out = args[0]
        rows = [{"strategy": s, "ranks": 2, "backend": "gloo", "accuracy": 0.9, "loss": 0.3, "seconds": 2.0,
                 "epoch_seconds": [2.0], "threads": 2} for s in ("ddp", "fsdp")]
        for s in ("ddp", "fsdp"):
            torch.save(DigitsCNN().state_dict(), f"{out}.{s}.pt")
        open(out, "w").write(json.dumps(rows))
        return 0

    monkeypatch.setattr(dl, "launch", fake_launch)
    before = torch.get_num_threads()
    ctx = DemoContext(device=torch.device("cpu"), dtype=torch.bfloat16, digits=load_digits(seed=0), progress=False)
    table = run(ctx)
    assert seen["omp"] == "2" and torch.get_num_threads() == before
    rows = {r[0]: dict(zip(table.columns, r)) for r in table.rows}
    assert rows["none (1 process)"]["threads/rank"] == 4 and rows["ddp"]["threads/rank"] == 2
    assert "-" in rows["ddp"]["epochs min-max"]
    notes = " ".join(table.notes)
    assert "2 thread(s) per rank" in notes and "4 in the single process" in notes and "median over the 1 epochs" in notes
    assert "{batch" not in notes
