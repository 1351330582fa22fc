"""``quant.export_onnx`` replaces the file whole: an export that fails or stops part way leaves the ONNX file that
was at the path as it was, and no temporary file beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import OverdriveError
from overdrive._utils.files import atomic_path

onnx = pytest.importorskip("onnx")


def _qmodel() -> nn.Module:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    return quant.quantize(nn.Sequential(nn.Linear(4, 2)), quant.INT8_DEFAULT, forward_loop=lambda m: m(x), fidelity=False)


def test_export_that_fails_part_way_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.onnx"
    quant.export_onnx(_qmodel(), torch.randn(2, 4), path)
    before = path.read_bytes()
    onnx.checker.check_model(onnx.load(str(path)))

    def torn(model, args, f=None, **kwargs):  # noqa: ANN001, ANN202 - torch.onnx.export's signature
        if f is not None:  # the TorchScript exporter: half a file, then a failure (a full disk, a kill)
            with open(f, "wb") as fh:
                fh.write(before[: len(before) // 2])
        raise RuntimeError("export stopped part way")

    monkeypatch.setattr(torch.onnx, "export", torn)
    with pytest.raises(OverdriveError, match="ONNX export failed"):
        quant.export_onnx(_qmodel(), torch.randn(2, 4), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_export_over_an_old_file_replaces_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"not onnx")
    path.chmod(0o640)
    quant.export_onnx(_qmodel(), torch.randn(2, 4), path)
    onnx.checker.check_model(onnx.load(str(path)))
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_atomic_path_removes_its_temporary_on_error(tmp_path: Path) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    with pytest.raises(ValueError), atomic_path(path) as tmp:
        tmp.write_bytes(b"ne")
        raise ValueError("writer failed")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]
