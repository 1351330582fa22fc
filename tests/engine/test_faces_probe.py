"""Model files met where an engine or a reference goes: a TorchScript file (what ``build --torchscript`` reads) is a
reference ``compare`` runs, not "a .pt file overdrive does not unpickle" (or, named ``.torchscript``, an engine with
the wrong magic); and an ONNX / TorchScript / torch.export / torch.save file given as an engine says what it is and
the build line that makes an engine from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Engine, compare


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = torch.relu(self.conv(x))
        return self.fc(f.mean((2, 3))), f


def _files(tmp_path: Path) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    model = _Net().eval()
    x = torch.randn(2, 3, 8, 8)
    onnx_path = tmp_path / "net.onnx"
    torch.onnx.export(model, (x,), str(onnx_path), input_names=["x"], output_names=["logits", "features"],
                      dynamo=False)
    torch.jit.save(torch.jit.trace(model, x), str(tmp_path / "net.pt"))
    (tmp_path / "net.torchscript").write_bytes((tmp_path / "net.pt").read_bytes())
    return model, onnx_path


@pytest.mark.parametrize("name", ["net.pt", "net.torchscript"])
def test_compare_runs_a_torchscript_file(tmp_path: Path, name: str) -> None:
    pytest.importorskip("onnxruntime")
    _, onnx_path = _files(tmp_path)
    report = compare(str(tmp_path / name), str(onnx_path), atol=1e-5, rtol=1e-5)
    assert report["passed"], report
    assert report["a"] == f"torchscript({name})"
    assert [o["name"] for o in report["outputs"]] == ["logits", "features"]
    assert all(o["max_abs"] <= 1e-5 for o in report["outputs"])  # fp32 TorchScript vs fp32 ONNX Runtime

    torch.manual_seed(1)  # another model's TorchScript: the comparison fails, so it did run the file
    other = tmp_path / "other.pt"
    torch.jit.save(torch.jit.trace(_Net().eval(), torch.randn(2, 3, 8, 8)), str(other))
    assert not compare(str(other), str(onnx_path), atol=1e-5, rtol=1e-5)["passed"]


def test_compare_still_refuses_a_torch_save_pickle(tmp_path: Path) -> None:
    torch.save(_Net().state_dict(), tmp_path / "w.pt")
    with pytest.raises(UsageError, match="torch.save file is not an engine.*TorchScript file"):
        compare(str(tmp_path / "w.pt"), str(tmp_path / "w.pt"))


def test_loading_a_model_file_as_an_engine_names_the_build_line(tmp_path: Path) -> None:
    model, onnx_path = _files(tmp_path)
    torch.save(model.state_dict(), tmp_path / "w.pth")
    ep = torch.export.export(model, (torch.randn(2, 3, 8, 8),))
    torch.export.save(ep, str(tmp_path / "net.pt2"))
    cases = {"net.onnx": "is an ONNX model.*overdrive build --onnx .*net.onnx --saveEngine net.engine",
             "net.torchscript": r"is a TorchScript module.*overdrive build --torchscript .*net.torchscript",
             "net.pt2": r"is a torch.export archive.*overdrive build --exported .*net.pt2",
             "w.pth": r"is a torch.save file.*--checkpoint .*w.pth"}
    for name, pattern in cases.items():
        with pytest.raises(UsageError, match=pattern):
            Engine.load(tmp_path / name)
    (tmp_path / "plan.engine").write_bytes(b"TRTPLAN!" + bytes(64))  # anything else: the magic, as before
    with pytest.raises(UsageError, match="wrong magic"):
        Engine.load(tmp_path / "plan.engine")
