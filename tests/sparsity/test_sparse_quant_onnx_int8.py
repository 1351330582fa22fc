"""sparsity.onnx_weight_sparsity on a sparse-quantized model whose weights were folded to int8 codes, as ONNX Runtime's
optimizer writes them for its integer kernels (``QuantizeLinear(W)`` folded into an int8 initializer read (in, out) by
``MatMulIntegerToFloat``): the pruned weights are found by their codes and checked on the integers themselves, 2:4
along the input dimension (dim 0 of the stored (in, out) weight)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from overdrive import quant, sparsity
from overdrive._utils.errors import UsageError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import numpy_helper  # noqa: E402


def _folded(tmp_path) -> tuple[sparsity.SparseHandle, nn.Module, str]:
    """A pruned, int8-calibrated MLP on a (B, T, C) input, exported and optimized by ONNX Runtime (extended level)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()
    handle = sparsity.sparsify(model)
    x = torch.randn(4, 6, 32)
    model = sparsity.sparse_quantize(handle, quant.INT8_DEFAULT, lambda m: m(x))
    path = quant.export_onnx(model, (x,), tmp_path / "mlp_int8.onnx")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "mlp_int8_ort.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    graph = onnx.load(so.optimized_model_filepath).graph
    weights = [i for i in graph.initializer if len(i.dims) == 2]
    if not weights or any(i.data_type != onnx.TensorProto.INT8 for i in weights):
        pytest.skip("this ONNX Runtime build does not fold the weights to int8 initializers")
    return handle, model, so.optimized_model_filepath


def test_int8_folded_weights_found_by_codes_and_checked_2to4(tmp_path) -> None:
    handle, model, path = _folded(tmp_path)
    graph = onnx.load(path).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer if len(i.dims) == 2}
    assert len(inits) == 2 and not {"0.weight", "2.weight"} & set(inits)  # only under generated names, as int8
    rows = sparsity.onnx_weight_sparsity(path, handle)
    assert [r["name"] for r in rows] == ["0.weight", "2.weight"]
    assert [r["shape"] for r in rows] == [[32, 64], [64, 16]]  # stored (in, out) for MatMulIntegerToFloat
    assert all(r["is_2to4"] and r["nonzero_fraction"] <= 0.5 for r in rows), rows
    # reference: the quantizer's codes, round-half-even(w / (amax / 127)) per output channel, against the file
    for layer, a in zip(handle.layers, inits.values()):
        q = layer.module.weight_quantizer
        w = layer.weight.detach().numpy()
        codes = np.clip(np.rint(w / (q.amax.numpy()[:, None] / 127.0)), -127, 127)
        assert np.abs(a.T.astype(np.float32) - codes).max() <= 1  # a tie may round the other way in fp32
        groups = (a.T != 0).reshape(a.shape[1], -1, 4).sum(-1)  # (out, in / 4) nonzeros of each 4 along input
        assert bool((groups <= 2).all())
    # without the handle: every int8 weight read by MatMulIntegerToFloat is read (in, out), so checked 2:4
    rows = sparsity.onnx_weight_sparsity(path)
    assert len(rows) == 2 and all(r["is_2to4"] for r in rows), rows


def test_int8_folded_weights_that_differ_are_an_error(tmp_path) -> None:
    handle, model, path = _folded(tmp_path)
    proto = onnx.load(path)
    for init in proto.graph.initializer:
        if len(init.dims) == 2 and tuple(init.dims) == (32, 64):
            a = numpy_helper.to_array(init).copy()
            a[a != 0] = np.clip(a[a != 0].astype(np.int16) + 3, -127, 127).astype(np.int8)  # 3 steps off
            init.CopyFrom(numpy_helper.from_array(a, init.name))
    onnx.save(proto, path)
    with pytest.raises(UsageError, match=r"no initializer named \['0.weight'\]"):
        sparsity.onnx_weight_sparsity(path, handle)
