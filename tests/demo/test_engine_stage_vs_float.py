"""The engine stage's "vs float engine" speed-up: its accuracy change is against the float engine's accuracy."""

from __future__ import annotations

import pytest

from overdrive.engine import Engine

pytest.importorskip("sklearn")  # run_demo loads the digits
pytest.importorskip("onnxruntime")


def test_int8_accuracy_change_is_against_the_float_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.demo import engine_stage, run_demo

    real = engine_stage._accuracy

    def skewed(fn, ctx, batch, pad=False):  # noqa: ANN001, ANN202 - the fp32 engine scores 1 point under PyTorch
        acc = real(fn, ctx, batch, pad)
        return acc - 0.01 if isinstance(fn, Engine) and fn.header.get("precision") == "fp32" else acc

    monkeypatch.setattr(engine_stage, "_accuracy", skewed)
    table = run_demo(device="cpu", stages=["engine"], progress=False, quick=True, epochs=1)[-1]
    assert table.stage == "engine" and table.status == "ok", table.rows
    acc = {r[0]: r[2] for r in table.rows}
    ups = {(s["label"], s["baseline"]): s["accuracy_delta"] for s in table.speedups}
    assert ups[("engine int8", "engine fp32")] == pytest.approx(100 * (acc["engine int8"] - acc["engine fp32"]))
    assert ups[("engine fp32", "PyTorch eager fp32")] == pytest.approx(100 * (acc["engine fp32"] - acc["PyTorch eager fp32"]))
