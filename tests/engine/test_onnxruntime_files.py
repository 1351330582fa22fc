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
