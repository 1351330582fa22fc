"""`overdrive demo --stage X`: a stage that brings its own model runs alone; one that starts from the O0-trained
model gets the amp stage first at O0 only (not every opt level), and the amp table says why it ran."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")

from overdrive._utils.table import Table  # noqa: E402
from overdrive.demo import STAGES, run_demo  # noqa: E402


@pytest.fixture(scope="module")
def digits():  # type: ignore[no-untyped-def]
    from overdrive.recipes.data import load_digits

    return load_digits(seed=0)


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch, digits) -> list[tuple[str, tuple[str, ...]]]:  # type: ignore[no-untyped-def]
    """Every stage replaced by a stand-in that records its name and the opt levels it was given."""
    import importlib

    monkeypatch.setattr("overdrive.demo.load_digits", lambda seed=0: digits)
    calls: list[tuple[str, tuple[str, ...]]] = []
    for name, module in STAGES.items():
        def fake(ctx, name=name):  # type: ignore[no-untyped-def]
            calls.append((name, ctx.opt_levels))
            if name == "amp":
                ctx.fp32_model = torch.nn.Identity()
            return Table(name, ["x"], [[1]])
        monkeypatch.setattr(importlib.import_module(module), "run", fake)
    return calls


@pytest.mark.parametrize("stage", ["transformer", "data", "distributed"])
def test_standalone_stage_runs_alone(stage: str, ran: list) -> None:
    run_demo(device="cpu", stages=[stage], quick=True, progress=False)
    assert [n for n, _ in ran] == [stage]


@pytest.mark.parametrize("stage", ["quant", "sparsity", "engine"])
def test_dependent_stage_gets_amp_at_o0_only(stage: str, ran: list) -> None:
    tables = run_demo(device="cpu", stages=[stage], quick=True, progress=False)
    assert ran == [("amp", ("O0",)), (stage, ("O0",))]
    assert any(f"stage 'amp' ran first, at O0 only: {stage}" in n for n in tables[0].notes)


def test_asked_for_amp_keeps_every_level(ran: list) -> None:
    tables = run_demo(device="cpu", stages=["amp", "quant"], quick=True, progress=False)
    assert ran[0] == ("amp", ("O0", "O1", "O2", "O3")) and not any("ran first" in n for n in tables[0].notes)


def test_a_stage_of_two_tables_says_how_long_it_took_once(monkeypatch: pytest.MonkeyPatch, ran: list) -> None:
    """The data stage returns its image table and its tokenization table: the report said "stage 'data' took" twice."""
    import importlib

    monkeypatch.setattr(importlib.import_module(STAGES["data"]), "run",
                        lambda ctx: [Table("images", ["x"], [[1]]), Table("tokenize", ["x"], [[1]])])
    tables = run_demo(device="cpu", stages=["data"], quick=True, progress=False)
    took = [[n for n in t.notes if n.startswith("stage 'data' took")] for t in tables]
    assert [len(t) for t in took] == [0, 1]
