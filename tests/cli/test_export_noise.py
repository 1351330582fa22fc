"""A wrong --shapes is one error line: torch's fake_tensor logger printed a ~30-line traceback before it,
and torch's messages can carry ANSI colour codes, which reached the user raw."""

from __future__ import annotations

from pathlib import Path

import pytest

from overdrive.cli.main import _escape, main


def test_ansi_codes_are_stripped_from_error_lines() -> None:
    assert _escape("\x1b[31mshape\x1b[0m  mismatch\n  at dim 1") == "shape mismatch at dim 1"


@pytest.mark.parametrize("backend", ["inductor", "auto"])  # auto on CPU: onnxruntime, through the ONNX exporters
def test_wrong_shapes_give_one_line(backend: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 3)\n")
    code = main(["build", "--model", f"{tmp_path / 'm.py'}:make", "--shapes", "input:2x5", "--backend", backend,
                 "--save-engine", str(tmp_path / "m.engine")])
    err = capfd.readouterr().err
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "[2, 5] X [4, 3]" in lines[0].replace("2x5", "[2, 5]"), err
    assert len(lines[0]) < 400 and "Next steps" not in lines[0], lines[0]  # the cause, not the exporter's advice
