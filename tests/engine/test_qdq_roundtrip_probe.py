"""Q/DQ models end to end: what ONNX Runtime, the engines and the importer compute from a Q/DQ graph against the
arithmetic the graph states (each QuantizeLinear / DequantizeLinear evaluated by hand in fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from overdrive.engine.backends import onnxruntime as ort_backend  # noqa: E402


def _relu_qdq_model(zp_type: int) -> bytes:
    """x -> Relu -> QuantizeLinear -> DequantizeLinear (scale 0.01, zero point 0 of ``zp_type``) -> y."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("QuantizeLinear", ["a", "s", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0.01, np.float32), "s"), helper.make_tensor("zp", zp_type, [], [0])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]).SerializeToString()


@pytest.mark.parametrize("zp_type", [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2, TensorProto.INT8])
@pytest.mark.parametrize("optimize", [True, False])
def test_onnxruntime_session_keeps_relu_before_fp8_quantize(tmp_path, zp_type, optimize):
    # A Relu in front of an fp8 QuantizeLinear must still clip the negatives: Q/DQ of relu(x) is >= 0. ONNX
    # Runtime's ReluQuantRewrite removed it (float8's zero point read as the lowest value), so -1.0 came out as -1.0.
    model = _relu_qdq_model(zp_type)
    x = np.linspace(-2.0, 2.0, 64, dtype=np.float32)
    opt = str(tmp_path / "opt.onnx") if optimize else None
    session = ort_backend._session(model, torch.device("cpu"), optimize_to=opt)
    y = session.run(None, {"x": x})[0]
    if optimize:  # the stored (optimized) model, as a build writes it, computes the same
        stored = ort_backend._session(open(opt, "rb").read(), torch.device("cpu"))
        np.testing.assert_array_equal(stored.run(None, {"x": x})[0], y)
    assert y.min() >= 0.0, f"negative outputs {y[y < 0][:4]}: the Relu before the Q/DQ pair was dropped"
    if zp_type == TensorProto.FLOAT8E4M3FN:  # relu(x) through e4m3 at scale 0.01, in torch
        want = (torch.from_numpy(x).relu() / 0.01).to(torch.float8_e4m3fn).float() * 0.01
        np.testing.assert_allclose(y, want.numpy(), rtol=0, atol=1e-7)


def test_dynamo_export_of_narrow_range_activations_loads_and_matches(tmp_path):
    # The torch.export-based exporter (the fallback for models the TorchScript one cannot take) clamps a
    # narrow-range activation before its Q/DQ; where a Relu feeds two such quantizers, its optimizer folded the Relu
    # into the clamps and left a Clip reading a tensor no node makes: ONNX Runtime refused the file ("relu_min_1 is
    # not a graph input").
    pytest.importorskip("onnxscript")
    import onnxruntime as ort
    from torch import nn

    from overdrive import quant
    from overdrive.quant import export as qexport

    torch.manual_seed(0)
    class Block(nn.Module):  # conv -> relu -> two quantized readers of the relu (a conv and a residual add)
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.c1(x))
            return y + self.c2(y)

    model = Block().eval()
    cfg = quant.INT8_DEFAULT.replace(input=quant.QuantizerConfig(narrow_range=True))
    data = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    qm = quant.quantize(model, cfg, forward_loop=lambda m: [m(d) for d in data])
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "m.onnx"
    assert qexport._export_dynamo(qm, qm, (x,), path, 18, ["input"], ["output"], None)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    got = ort.InferenceSession(str(path), so).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        want = qm(x)
    # the same Q/DQ arithmetic: equal up to fp32 rounding (x / s against x * (1 / s) may move a value one int8 step
    # of the input's scale, far below this bound)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-2 * float(want.abs().max()))
