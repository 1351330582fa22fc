"""The quant table shows ties: a 10-way tie at the best PTQ accuracy is marked on every tied calibrator (not
"max (best)" on the first), and layer sensitivities read in points to 2 decimals and in test images, with a
tie across every layer said so (it was "+0.0" for each)."""

from __future__ import annotations

from overdrive._utils.table import Table
from overdrive.demo.quant_stage import tie_notes


def _table(accs: dict[str, float]) -> Table:
    rows = [["fp32", "-", 0.97, 0.0]]
    rows += [["int8 PTQ", name + (" (best)" if i == 0 else ""), a, 0.0] for i, (name, a) in enumerate(accs.items())]
    return Table("q", ["model", "calibration", "test accuracy", "vs fp32 (points)"], rows)


def test_tied_calibrators_all_marked() -> None:
    t = _table({"max": 0.9722, "entropy": 0.9722, "mse": 0.9694})
    notes = tie_notes(t, [{"layer": "a", "drop": 0.0}, {"layer": "b", "drop": 0.0}], 360)
    assert [r[1] for r in t.rows[1:]] == ["max (tied best)", "entropy (tied best)", "mse"]
    assert "2 calibrators tie" in notes[0] and "350 of 360" in notes[0]
    assert "all 2 layers tie at +0.00 points (+0 of 360 test images)" in notes[1]


def test_single_best_and_ranked_layers() -> None:
    t = _table({"max": 0.95, "entropy": 0.9722})
    notes = tie_notes(t, [{"layer": "conv", "drop": 2 / 360}, {"layer": "fc", "drop": 1 / 360}], 360)
    assert [r[1] for r in t.rows[1:]] == ["max", "entropy (best)"]
    assert notes == ["most sensitive layers (accuracy drop when quantized alone, of 360 test images): "
                     "conv (+0.56 points, +2 images), fc (+0.28 points, +1 images)"]
