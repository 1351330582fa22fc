"""quant.export_onnx checks the amax of the quantizers the example forward reaches, not of every quantizer."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from overdrive import quant
from overdrive._utils.errors import UsageError

pytest.importorskip("onnx")


class _AuxHead(nn.Module):
    """A classifier with a training-only auxiliary head (GoogLeNet / Inception style)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.fc1(x))
        return (self.fc2(h), self.aux(h)) if self.training else self.fc2(h)


def _calibrated_eval_path() -> nn.Module:
    """Calibrated as pytorch-quantization does it (collect, then load_calib_amax(strict=False)) on eval batches:
    the auxiliary head's input quantizer sees no data and keeps no amax."""
    torch.manual_seed(0)
    model = quant.quantize(_AuxHead().eval(), quant.INT8_DEFAULT)
    qs = [q for _, q in quant.quantizers(model)]
    for q in qs:
        q.enable_calib()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "the calibrator saw no data": the auxiliary head's
        for q in qs:
            q.load_calib_amax(strict=False)
            q.disable_calib()
    assert model.aux.input_quantizer.amax is None and model.fc1.input_quantizer.amax is not None
    return model


def test_an_unreached_quantizer_without_amax_does_not_stop_the_export(tmp_path: Path) -> None:
    import onnx

    model = _calibrated_eval_path()
    path = quant.export_onnx(model, (torch.randn(2, 8),), tmp_path / "m.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("QuantizeLinear") >= 2 and ops.count("Gemm") + ops.count("MatMul") == 2


def test_a_reached_quantizer_without_amax_is_refused(tmp_path: Path) -> None:
    model = _calibrated_eval_path()
    model.fc2.input_quantizer.reset_amax()
    with pytest.raises(UsageError, match=r"quantizer\(s\) \['fc2.input_quantizer'\] have no amax"):
        quant.export_onnx(model, (torch.randn(2, 8),), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
