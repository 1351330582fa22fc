"""``overdrive build --exported m.pt2`` without --shapes builds at the archive's example inputs (it asked for
--shapes although torch.export.save stores them)."""

from __future__ import annotations

from pathlib import Path

import torch

from overdrive.cli.main import main
from overdrive.engine import Engine


def test_exported_archive_builds_at_its_example_inputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    torch.export.save(torch.export.export(m, (x,)), tmp_path / "m.pt2")
    eng = tmp_path / "m.engine"
    assert main(["build", "--exported", str(tmp_path / "m.pt2"), "--backend", "onnxruntime", "--device", "cpu",
                 "--save-engine", str(eng)]) == 0
    e = Engine.load(str(eng))
    assert [tuple(p.opt) for p in e.profiles] == [(2, 4)]
    with torch.no_grad():
        torch.testing.assert_close(e.run(x)[0], m(x), atol=1e-5, rtol=1e-5)
