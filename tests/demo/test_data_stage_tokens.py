"""The demo's tokenization table: overdrive.data.tokenize timed against the tokenizer's own loops on the same
texts, with every text's ids checked against ``tokenizer.encode`` (reference: that loop, exact equality)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tokenizers")

from overdrive.demo import data_stage  # noqa: E402
from overdrive.demo.context import DemoContext  # noqa: E402
from overdrive.demo.workloads import choose_workload  # noqa: E402


def _ctx() -> DemoContext:
    dev = torch.device("cpu")
    w = choose_workload(dev, True, None, 1)
    return DemoContext(device=dev, dtype=torch.bfloat16, digits=None, epochs=1, batch_size=w.batch_size,
                       progress=False, workload=w)


def test_tokenize_table_times_every_run_and_checks_every_text() -> None:
    table = data_stage.tokenize_table(_ctx(), n_texts=600)
    assert table.status == "ok" and len(table.rows) == 4
    loop, batch, ours, cached = table.rows
    assert loop[3] == pytest.approx(1.0) and loop[5] == 0
    for row in (batch, ours, cached):
        assert row[5] == 0  # every text's ids equal tokenizer.encode(text).ids
        assert row[1] > 0 and row[2] > row[1]  # tokens/s above texts/s: texts hold several tokens
    assert "from its disk cache" in cached[0]
    assert [s["baseline"] for s in table.speedups] == ["per-text encode loop"]
    assert table.speedups[0]["accuracy_delta"] == 0.0
    assert not any("did not load the cache" in n for n in table.notes)


def test_tokenize_table_differing_texts_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenize whose ids differ from encode's shows the count (the check is not a constant 0) and no accuracy."""
    from overdrive.data import tokenize as real

    def off_by_one(texts, tok, **kw):  # type: ignore[no-untyped-def]
        out = real(texts, tok, **kw)
        out.ids[out.offsets[1]] += 1  # the second text's first id
        return out

    monkeypatch.setattr("overdrive.data.tokenize", off_by_one)
    table = data_stage.tokenize_table(_ctx(), n_texts=50)
    assert [r[5] for r in table.rows] == [0, 0, 1, 1]
    assert table.speedups[0]["accuracy_delta"] is None


def test_tokenize_table_without_tokenizers_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive._utils.errors import MissingDependencyError

    def missing(*a, **k):  # type: ignore[no-untyped-def]
        raise MissingDependencyError("tokenizers", "text", "training a local tokenizer")

    import sys

    monkeypatch.setattr(sys.modules["overdrive.data.tokenize"], "train_local_tokenizer", missing)
    table = data_stage.tokenize_table(_ctx(), n_texts=50)
    assert table.status == "skipped" and "tokenizers" in " ".join(table.notes)


def test_a_broken_tokenization_leaves_the_image_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_stage, "images_table", lambda ctx: data_stage.Table("images", ["x"], [[1]], stage="data"))

    def broken(ctx):  # type: ignore[no-untyped-def]
        raise ValueError("bad corpus")

    monkeypatch.setattr(data_stage, "tokenize_table", broken)
    images, tokens = data_stage.run(_ctx())
    assert images.rows == [[1]] and tokens.status == "failed" and "ValueError: bad corpus" in tokens.rows[0][1]
