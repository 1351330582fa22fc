"""The `overdrive data` verb (the lean-import check for overdrive.data is in tests/test_lean_import.py)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner


def test_cli_bench_json(folder: Path) -> None:
    from overdrive.cli.data import command

    res = CliRunner().invoke(command, ["bench", str(folder), "--batch-size", "4", "--size", "8", "--workers", "0",
                                       "--batches", "2", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert rows[0]["pipeline"] == "cpu (0 workers)" and rows[0]["img_per_s"] > 0 and rows[0]["vs_best"] == 1.0


def test_cli_make_dataset_and_errors(tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("skimage")
    from overdrive.cli.main import main

    assert main(["data", "make-dataset", str(tmp_path / "d"), "-n", "4", "--width", "40", "--height", "30"]) == 0
    files = sorted((tmp_path / "d").rglob("*.jpg"))
    assert len(files) == 4 and files[0].read_bytes()[:2] == b"\xff\xd8"
    assert main(["data", "make-dataset", str(tmp_path / "e"), "-n", "0"]) == 2
    # into a folder that holds files: it replaced same-named images and left the rest beside the new ones
    before = {f: f.read_bytes() for f in files}
    assert main(["data", "make-dataset", str(tmp_path / "d"), "-n", "2", "--classes", "1"]) == 2
    assert {f: f.read_bytes() for f in sorted((tmp_path / "d").rglob("*.jpg"))} == before
    # a 1-pixel size rounded to 0 after the class folders were made ("height and width must be > 0", exit 1)
    assert main(["data", "make-dataset", str(tmp_path / "f"), "-n", "2", "--width", "1", "--height", "1"]) == 2
    assert not (tmp_path / "f").exists()
    # a negative seed: numpy's error named no flag and came after the class folders, so a rerun met "not empty"
    assert main(["data", "make-dataset", str(tmp_path / "s"), "-n", "2", "--seed", "-1"]) == 2
    assert not (tmp_path / "s").exists()
    from overdrive._utils.errors import UsageError
    from overdrive.data import make_sample_dataset

    with pytest.raises(UsageError, match=r"seed=-1 must be an int >= 0 \(--seed\)"):
        make_sample_dataset(tmp_path / "s", n=2, seed=-1)
    assert not (tmp_path / "s").exists()

    with pytest.warns(RuntimeWarning, match="3 class folder"):  # 5 classes for 2 images: 3 empty, said now
        make_sample_dataset(tmp_path / "g", n=2, classes=5, size=(40, 30))
    assert main(["data", "bench", str(tmp_path / "d"), "--batch-size", "0", "--device", "cpu"]) == 2


def test_cli_bench_bad_device_is_a_usage_error(folder: Path) -> None:
    """--device gpu raised torch's RuntimeError (exit 1, a list of every device type torch knows)."""
    from overdrive.cli.main import main

    assert main(["data", "bench", str(folder), "--batch-size", "4", "--size", "8", "--workers", "0", "--device", "gpu"]) == 2
