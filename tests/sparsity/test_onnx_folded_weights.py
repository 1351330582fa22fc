"""sparsity.onnx_weight_sparsity(path, handle) on a plain ``torch.onnx.export``: constant folding (its default) stores
a Linear on a (B, T, C) input as a MatMul with its weight transposed, (in, out), under a generated name
(``onnx::MatMul_14``); the check raised 'has no initializer named' instead of reading those weights."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from overdrive import sparsity
from overdrive._utils.errors import UsageError

onnx = pytest.importorskip("onnx")


def _export(model: nn.Module, path) -> None:
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 5, 32),), str(path), dynamo=False)  # do_constant_folding=True


def test_folded_transposed_weights_found_by_value_and_read_as_2to4(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).eval()
    handle = sparsity.sparsify(model)
    path = tmp_path / "mlp.onnx"
    _export(model, path)
    names = {i.name for i in onnx.load(str(path)).graph.initializer}
    assert "0.weight" not in names  # folded: the weights are only under generated names, (in, out)
    rows = sparsity.onnx_weight_sparsity(path, handle)
    assert [r["name"] for r in rows] == ["0.weight", "2.weight"]
    assert [r["shape"] for r in rows] == [[32, 32], [32, 16]]  # as stored in the file
    assert all(r["is_2to4"] and r["nonzero_fraction"] == 0.5 for r in rows), rows


def test_weights_changed_after_export_are_an_error_naming_the_export_options(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32)).eval()
    handle = sparsity.sparsify(model)
    path = tmp_path / "one.onnx"
    _export(model, path)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # trained on after the export: the file no longer holds these values
    with pytest.raises(UsageError, match=r"no initializer named \['0.weight'\], nor one equal to their weights.*"
                                         r"do_constant_folding=False"):
        sparsity.onnx_weight_sparsity(path, handle)
