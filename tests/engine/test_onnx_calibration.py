"""int8 engines from a float ONNX model with calibration batches (trtexec --int8 --calib): ONNX Runtime's static
quantization makes the Q/DQ model, and both backends run it. References: the float model (int8 error bound),
and the Q/DQ model run by ONNX Runtime itself (the two backends must agree with it)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, ShapeProfile
from overdrive.engine.backends.onnxruntime import has_qdq
from overdrive.engine.onnx import quantize_onnx, quantize_onnx_integer

ort = pytest.importorskip("onnxruntime")

STATIC = [ShapeProfile.fixed("x", (8, 1, 8, 8))]


def _calib() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 1, 8, 8, generator=g),) for _ in range(4)]


def _ort(model: bytes, x: torch.Tensor, fused: bool = False) -> np.ndarray:
    so = ort.SessionOptions()
    # exact Q/DQ arithmetic; fused: ONNX Runtime's integer kernels, whose requantization rounds as the engine's does
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if fused
                                   else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]


def test_quantize_onnx_makes_a_per_channel_qdq_model(digits_onnx: bytes) -> None:
    import onnx

    qdq = quantize_onnx(digits_onnx, _calib(), "int8")
    graph = onnx.load_from_string(qdq).graph
    inits = {t.name: t for t in graph.initializer}
    int8_weight_scales = [int(np.prod(inits[n.input[1]].dims)) for n in graph.node if n.op_type == "DequantizeLinear"
                          and n.input[0] in inits and inits[n.input[0]].data_type == onnx.TensorProto.INT8]
    n_weights = sum(n.op_type in ("Conv", "Gemm", "MatMul") for n in graph.node)
    assert has_qdq(qdq) and not has_qdq(digits_onnx)
    assert len(int8_weight_scales) == n_weights and all(s > 1 for s in int8_weight_scales)  # per channel, each layer
    assert "QuantizeLinear" in [n.op_type for n in graph.node]  # and quantized activations
    x = _calib()[0][0]
    ref, got = _ort(digits_onnx, x), _ort(qdq, x)
    assert np.abs(got - ref).max() <= 0.1 * np.abs(ref).max()  # int8 error, a tenth of the output range


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_float_onnx_int8_engine_is_calibrated(digits_onnx: bytes, backend: str) -> None:
    """Before, the onnxruntime backend refused a float ONNX model at int8, and the inductor backend built it
    in fp32 while labelling it int8."""
    calib = _calib()
    eng = Builder(precision="int8", backend=backend, device="cpu", profiles=STATIC).build(digits_onnx, calib=calib)
    assert eng.header["precision"] == "int8" and "quantize_static" in eng.header["calibration"]
    x = calib[0][0]
    integer = eng.header["backend_meta"].get("int8_layout") == "integer"  # onnxruntime: the faster layout, timed
    qdq = quantize_onnx_integer(digits_onnx, calib) if integer else quantize_onnx(digits_onnx, calib, "int8")
    ref_qdq = _ort(qdq, x, fused=integer)
    out = eng(x)
    out = (out[0] if isinstance(out, (list, tuple)) else out).float().numpy()
    assert np.abs(out - ref_qdq).max() <= 1e-4 * max(np.abs(ref_qdq).max(), 1.0)  # the same Q/DQ arithmetic
    assert not np.allclose(out, _ort(digits_onnx, x), atol=1e-6)  # and not the float model


def test_int8_without_calib_warns_timing_only(digits_onnx: bytes) -> None:
    with pytest.warns(UserWarning, match="without calibration data"):
        eng = Builder(precision="int8", backend="onnxruntime", device="cpu", profiles=STATIC).build(digits_onnx)
    assert has_qdq(eng.sections["onnx"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Q/DQ model needs no calibration: no warning
        Builder(precision="int8", backend="onnxruntime", device="cpu", profiles=STATIC).build(
            quantize_onnx(digits_onnx, _calib(), "int8"))


def test_calibration_batches_must_match_the_inputs(digits_onnx: bytes) -> None:
    bad = [(torch.randn(8, 1, 8, 8), torch.randn(8, 1, 8, 8))]
    with pytest.raises(UsageError, match=r"calibration batch 0 has 2 tensor\(s\) but the ONNX model takes 1"):
        Builder(precision="int8", backend="onnxruntime", device="cpu", profiles=STATIC).build(digits_onnx, calib=bad)


def test_importer_runs_an_fp8_qdq_model(digits_onnx: bytes) -> None:
    """ONNX Runtime's fp8 Q/DQ model stores float8 initializers (zero points), which onnx hands over as
    ml_dtypes arrays; before, the importer failed on them with numpy's "can't convert np.ndarray" TypeError."""
    from overdrive.engine.onnx import import_onnx

    calib = _calib()
    qdq = quantize_onnx(digits_onnx, calib, "fp8")
    x = calib[0][0]
    with torch.no_grad():
        out = import_onnx(qdq)(x)
    out = (out[0] if isinstance(out, (list, tuple)) else out).float().numpy()
    ref = _ort(digits_onnx, x)
    assert np.abs(out - ref).max() <= 0.15 * np.abs(ref).max()  # fp8 e4m3 error, within 15% of the output range
    assert not np.allclose(out, ref, atol=1e-6)  # and the Q/DQ arithmetic ran, not the float model


def test_importer_keeps_an_int8_qdq_model_on_the_inputs_device(digits_onnx: bytes) -> None:
    """The int32 biases of ONNX Runtime's Q/DQ model are small integer constants kept on the host; dequantized,
    they were added as CPU tensors to the model's device activations ("found two different devices cuda:0,
    cpu" on the GPU). The meta device stands in for the GPU here."""
    from overdrive.engine.onnx import import_onnx

    mod = import_onnx(quantize_onnx(digits_onnx, _calib(), "int8")).to("meta")
    with torch.no_grad():
        out = mod(torch.empty(8, 1, 8, 8, device="meta"))
    out = out[0] if isinstance(out, (list, tuple)) else out
    assert out.device.type == "meta" and tuple(out.shape) == (8, 10)


def test_an_input_without_a_batch_dim_is_not_cut_into_calibration_rows() -> None:
    # a model taking a shared bias of shape (4,) beside its batch of 3: the calibration batches were concatenated and
    # cut by 3 rows each, bias included, and ONNX Runtime refused the (3,) bias; the bias now passes whole
    from overdrive.engine.onnx.quantize import fit_batches

    x = [torch.full((2, 5), float(i)) for i in range(3)]
    bias = torch.arange(4.0)
    batches = fit_batches([(t, bias) for t in x], [[3, 5], [4]], ["x", "bias"])
    assert [tuple(t.shape) for b in batches for t in b] == [(3, 5), (4,), (3, 5), (4,)]
    assert all(torch.equal(b[1], bias) for b in batches)
    assert torch.equal(torch.cat([b[0] for b in batches]), torch.cat(x)[:6])

    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(5, 4)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + bias

    torch.manual_seed(0)
    m = Biased().eval()
    ex = (torch.randn(3, 5), torch.randn(4))
    eng = Builder(backend="onnxruntime", precision="int8").build(
        m, ex, input_names=["x", "bias"], calib=[(torch.randn(2, 5), ex[1]) for _ in range(3)])
    got = torch.as_tensor(np.asarray(eng(*ex)))
    with torch.no_grad():
        want = m(*ex)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
