"""The onnxruntime backend closes the files it reads (/proc/cpuinfo, the optimized ONNX model): each
left an unclosed file to the garbage collector, a ResourceWarning shown to CLI users."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def _resource_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        fn()
        gc.collect()
    return [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]


def test_int8_kernel_check_closes_proc_cpuinfo() -> None:
    from overdrive.engine.backends.onnxruntime import int8_kernels_exact

    assert _resource_warnings(int8_kernels_exact) == []


def test_build_closes_the_optimized_model() -> None:
    from onnx import TensorProto as T, helper as h

    from overdrive.engine import Builder, BuildConfig

    m = h.make_model(h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
                                  [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                                  [h.make_tensor_value_info("y", T.FLOAT, [2, 3])]),
                     opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx_bytes = m.SerializeToString()

    def build() -> None:
        engine = Builder(BuildConfig(backend="onnxruntime")).build(onnx_bytes)
        assert torch.equal(engine(torch.tensor([[-1.0, 2.0, 0.0]] * 2)), torch.tensor([[0.0, 2.0, 0.0]] * 2))

    assert _resource_warnings(build) == []


def test_onnx_calibration_closes_its_files() -> None:
    """quantize_onnx (static Q/DQ, calibrated) and quantize_onnx_dynamic write and read temporary ONNX files."""
    from onnx import TensorProto as T, helper as h, numpy_helper

    from overdrive.engine.onnx.quantize import quantize_onnx, quantize_onnx_dynamic

    g = torch.Generator().manual_seed(0)
    w = numpy_helper.from_array(torch.randn(8, 4, generator=g).numpy(), "w")
    m = h.make_model(h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                  [h.make_tensor_value_info("x", T.FLOAT, [2, 8])],
                                  [h.make_tensor_value_info("y", T.FLOAT, [2, 4])], initializer=[w]),
                     opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx_bytes = m.SerializeToString()
    calib = [(torch.randn(2, 8, generator=g),) for _ in range(2)]
    assert _resource_warnings(lambda: quantize_onnx(onnx_bytes, calib, "int8")) == []
    assert _resource_warnings(lambda: quantize_onnx_dynamic(onnx_bytes)) == []
