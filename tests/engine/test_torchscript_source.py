"""``--torchscript`` sources: a TorchScript file records no input dtypes, so index inputs (embedding ids, gather
indices) and boolean masks are found from how the graph uses them; ``--shapes`` binds by the forward's names;
a wrong input count or a failing export is one line naming the cause. Outputs against eager fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive.engine import Engine
from overdrive.engine.input_dtypes import torchscript_inputs
from overdrive.recipes.build import build_engine

pytest.importorskip("onnxruntime")


class LookupMask(nn.Module):
    """ids (B, L) int64 through an embedding bag (after a reshape), x (B, L, D) float, mask (B, L) bool."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(20, 8, mode="mean")
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = self.bag(ids.reshape(ids.shape[0], -1))  # (B, D)
        kept = x.masked_fill(~mask.unsqueeze(-1), 0.0).sum(1)  # (B, D)
        return self.proj(pooled + kept)


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (2, 5), generator=g)
    x = torch.randn(2, 5, 8, generator=g)
    mask = torch.tensor([[True] * 5, [True, True, False, False, True]])
    return ids, x, mask


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    model = LookupMask().eval()
    path = tmp_path_factory.mktemp("ts") / "lookup.pt"
    with torch.no_grad():
        torch.jit.trace(model, _inputs()).save(str(path))
    return path, model


def test_input_dtypes_come_from_the_graph(scripted: tuple[Path, nn.Module]) -> None:
    assert torchscript_inputs(torch.jit.load(str(scripted[0]))) == [("ids", torch.int64), ("x", torch.float32),
                                                                     ("mask", torch.bool)]


def test_index_and_mask_inputs_build_and_match_eager(scripted: tuple[Path, nn.Module], tmp_path: Path) -> None:
    """Every input was made with torch.randn: the export failed on the float embedding indices. --shapes is given
    in another order than forward's (mask, x, ids) and binds by name. Tolerance: fp32 ONNX Runtime vs eager, 1e-5."""
    path, model = scripted
    eng_path = tmp_path / "lookup.engine"
    build_engine(torchscript=str(path), save_engine=str(eng_path), shapes="mask:2x5,x:2x5x8,ids:2x5",
                 device="cpu", backend="onnxruntime")
    eng = Engine.load(eng_path)
    assert eng.input_names == ["ids", "x", "mask"]
    assert [str(d) for d in eng.input_dtypes] == ["torch.int64", "torch.float32", "torch.bool"]
    xs = _inputs()
    with torch.no_grad():
        ref = model(*xs)
    torch.testing.assert_close(eng(*xs), ref, atol=1e-5, rtol=1e-5)


def test_wrong_input_count_is_one_line(scripted: tuple[Path, nn.Module], tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"takes 3 input\(s\) \['ids', 'x', 'mask'\], but the shapes name 1") as e:
        build_engine(torchscript=str(scripted[0]), save_engine=str(tmp_path / "a.engine"), shapes="ids:2x5",
                     device="cpu", backend="onnxruntime")
    assert "\n" not in str(e.value)


def test_export_error_names_the_cause_not_the_torchscript_trace(tmp_path: Path) -> None:
    path = tmp_path / "conv.pt"
    torch.jit.trace(nn.Conv2d(3, 4, 3), torch.randn(1, 3, 8, 8)).save(str(path))
    with pytest.raises(OverdriveError, match=r"inputs x 1x5x8x8 float32: RuntimeError: Given groups=1.*5 channels") as e:
        build_engine(torchscript=str(path), save_engine=str(tmp_path / "a.engine"), shapes="x:1x5x8x8",
                     device="cpu", backend="onnxruntime")
    assert "\n" not in str(e.value) and "TorchScript interpreter" not in str(e.value)


def test_not_a_torchscript_file(tmp_path: Path) -> None:
    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"not a zip")
    with pytest.raises(UsageError, match=r"m.onnx: not a loadable TorchScript file"):
        build_engine(torchscript=str(bad), save_engine=str(tmp_path / "a.engine"), shapes="x:1x3", device="cpu")
