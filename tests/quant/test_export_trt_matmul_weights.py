"""ONNX export of a transformer block: weight Q/DQ feeds each MatMul directly (TensorRT's explicit-quantization
rule), per-channel along the output channel of the (in, out) weight, with initializer scales and zero points."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive import quant

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


class _Block(nn.Module):
    """LayerNorm, a fused qkv Linear, matmul attention, an output Linear, a GELU MLP and two residual adds."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff, self.ff2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v  # (B, T, d)
        x = x + self.o(a)
        return x + self.ff2(F.gelu(self.ff(x)))


@pytest.fixture(scope="module")
def block_onnx(tmp_path_factory):
    torch.manual_seed(0)
    model = _Block().eval()
    calib = [torch.randn(4, 6, 16) for _ in range(4)]
    q = quant.quantize(copy.deepcopy(model), quant.INT8_ATTENTION, forward_loop=lambda m: [m(x) for x in calib])
    path = quant.export_onnx(q, (torch.randn(1, 6, 16),), tmp_path_factory.mktemp("trt") / "block_int8.onnx")
    return q, model, onnx.load(str(path)), path


def test_weight_dq_feeds_matmul_directly(block_onnx) -> None:
    q, model, proto, _ = block_onnx
    g = proto.graph
    prod = {o: n for n in g.node for o in n.output}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    weighted = 0
    for n in g.node:
        if n.op_type != "MatMul":
            continue
        assert all(prod[i].op_type == "DequantizeLinear" for i in n.input), (n.name, [prod[i].op_type for i in n.input])
        dq = prod[n.input[1]]
        qn = prod[dq.input[0]]
        if qn.input[0] not in inits:
            continue  # an activation-by-activation matmul (QK^T, PV)
        weighted += 1
        w = inits[qn.input[0]]
        layer = getattr(model, n.name.split("/")[1])
        # the initializer is the Linear's weight stored (in, out); one scale per output channel, along axis 1
        np.testing.assert_array_equal(w, layer.weight.detach().numpy().T)
        for node in (qn, dq):
            assert [a.i for a in node.attribute if a.name == "axis"] == [1]
            assert inits[node.input[1]].shape == (w.shape[1],)
    assert weighted == 4
    assert not [n for n in g.node if n.op_type == "Transpose" and prod.get(n.input[0], n).op_type == "DequantizeLinear"]


def test_scales_and_zero_points_are_initializers(block_onnx) -> None:
    _, _, proto, _ = block_onnx
    g = proto.graph
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    qdq = [n for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(qdq) == 28
    for n in qdq:
        scale, zp = inits[n.input[1]], inits[n.input[2]]
        assert scale.dtype == np.float32 and np.all(np.isfinite(scale)) and np.all(scale > 0), n.name
        assert zp.dtype == np.int8 and not np.any(zp), n.name
    dims = [d.dim_param for d in g.input[0].type.tensor_type.shape.dim]
    assert dims[0] == "batch"
    onnx.checker.check_model(proto, full_check=True)


def test_block_ort_matches_fake_quant(block_onnx) -> None:
    q, _, _, path = block_onnx
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(1))  # batch 3: the dynamic batch axis
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        ref = q(x).numpy()
    step = max(float(m.amax) for n, m in quant.quantizers(q) if m.amax is not None and m.amax.numel() == 1) / 127
    assert np.abs(got - ref).max() <= step  # within one activation quantization step (float summation order)
