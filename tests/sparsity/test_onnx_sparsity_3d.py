"""sparsity.onnx_weight_sparsity on a sparse-quantized Linear run on a (B, T, C) input: the int8 export stores that
weight (in, out) as the MatMul's second input (TensorRT wants its DequantizeLinear to feed the MatMul directly), so
its 2:4 groups run along dim 0; read as (out, in) the check said the pruned weight was not 2:4."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive import quant, sparsity

pytest.importorskip("onnx")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 32)
        return self.fc2(torch.relu(self.fc1(x)))


def test_pruned_weights_of_a_3d_linear_read_as_2to4(tmp_path) -> None:
    torch.manual_seed(0)
    model = _Block().eval()
    handle = sparsity.sparsify(model)
    batches = [torch.randn(2, 5, 32) for _ in range(4)]
    qmodel = sparsity.sparse_quantize(handle, quant.INT8_DEFAULT, lambda m: [m(x) for x in batches])
    path = quant.export_onnx(qmodel, (torch.randn(2, 5, 32),), tmp_path / "block.onnx")
    rows = sparsity.onnx_weight_sparsity(path, handle)
    assert [r["name"] for r in rows] == [layer.name for layer in handle.layers] and rows
    assert all(r["is_2to4"] for r in rows), rows
