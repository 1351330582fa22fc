"""ONNX files as exporters other than ``torch.onnx`` write them, each checked against ONNX Runtime (the reference):
tf2onnx / keras2onnx's Conv, pools and ConvTranspose with auto_pad SAME_UPPER / SAME_LOWER and no pads (an NHWC
graph with Transposes around the conv), ConvTranspose with output_shape; LayerNormalization with a scale and bias
that broadcast, and with its Mean and InvStdDev outputs; ReduceMean of integers; Constant's sparse_value;
model-local functions; and the clear refusals: ai.onnx.ml and com.microsoft operators, ONNX Runtime's
default-domain extensions, string constants, external data that was not loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import import_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from ._onnx_nodes import check as _check  # noqa: E402
from ._onnx_nodes import one_node as _one_node  # noqa: E402

TOL = 1e-5  # fp32 against ONNX Runtime's fp32, absolute and relative; integer outputs are exact


def _f(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _model(nodes: list, inputs: dict[str, np.ndarray], outputs: list[str], inits: dict[str, np.ndarray],
           opset: int = 17, domains: tuple[str, ...] = ()) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in inputs.items()]
    g = helper.make_graph(nodes, "g", ins, [helper.make_empty_tensor_value_info(o) for o in outputs],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                               *(helper.make_opsetid(d, 1) for d in domains)])


def _check_all(model: onnx.ModelProto, feeds: dict[str, np.ndarray], tol: float = TOL) -> None:
    """Every output of the importer equals ONNX Runtime's in dtype and shape, and in value within ``tol``."""
    data = model.SerializeToString()
    refs = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    outs = import_onnx(data)(*(torch.from_numpy(v) for v in feeds.values()))
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        out = out.numpy()
        assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


# --- auto_pad SAME, as tf2onnx writes a Keras padding="same" layer -------------------------------------------------
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("stride_kernel_size", [(1, 3, 7), (2, 3, 7), (2, 4, 8), (3, 2, 7)])
def test_nhwc_conv_with_auto_pad_matches_onnxruntime(auto_pad: str, stride_kernel_size: tuple[int, int, int]) -> None:
    """It failed to import ("auto_pad='SAME_UPPER' is not supported"); odd total pads (stride 2, even kernel) put
    the extra row at the end for SAME_UPPER, at the start for SAME_LOWER."""
    s, k, h = stride_kernel_size
    n = helper.make_node
    nodes = [n("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2]),
             n("Conv", ["xt", "w", "b"], ["c"], auto_pad=auto_pad, strides=[s, s], kernel_shape=[k, k]),
             n("Relu", ["c"], ["r"]), n("Transpose", ["r"], ["y"], perm=[0, 2, 3, 1])]
    _check_all(_model(nodes, {"x": _f(0, 2, h, h + 1, 3)}, ["y"], {"w": _f(1, 4, 3, k, k), "b": _f(2, 4)}, 13),
               {"x": _f(0, 2, h, h + 1, 3)})


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("pool", [("MaxPool", {}), ("AveragePool", {}), ("AveragePool", {"count_include_pad": 1})])
def test_pools_with_auto_pad_same_match_onnxruntime(auto_pad: str, pool: tuple[str, dict]) -> None:
    op, attrs = pool
    _check(*_one_node(op, [("x", _f(3, 1, 3, 7, 8))], {"auto_pad": auto_pad, "strides": [2, 2],
                                                         "kernel_shape": [3, 3], **attrs}, 13))


@pytest.mark.parametrize("attrs", [{"auto_pad": "SAME_UPPER"}, {"auto_pad": "SAME_LOWER"},
                                   {"auto_pad": "SAME_UPPER", "output_shape": [10, 11]},
                                   {"output_shape": [10, 11]}, {"output_shape": [9, 9]}],
                         ids=["same_upper", "same_lower", "same_upper_output_shape", "output_shape",
                              "output_shape_odd"])
@pytest.mark.parametrize("kernel", [3, 4])
def test_conv_transpose_with_auto_pad_or_output_shape_matches_onnxruntime(attrs: dict, kernel: int) -> None:
    """It was refused ("ConvTranspose with output_shape or auto_pad SAME is not supported"): the full output is
    cropped to in * stride (or output_shape), an odd crop at the end for SAME_UPPER, at the start otherwise."""
    _check(*_one_node("ConvTranspose", [("x", _f(4, 1, 3, 5, 6)), ("c_w", _f(5, 3, 2, kernel, kernel))],
                      {"strides": [2, 2], **attrs}, 13))


def test_conv_transpose_output_shape_beyond_the_full_output_is_refused_clearly() -> None:
    model, feeds = _one_node("ConvTranspose", [("x", _f(4, 1, 3, 5, 5)), ("c_w", _f(5, 3, 2, 3, 3))],
                             {"strides": [2, 2], "output_shape": [13, 13]}, 13)
    with pytest.raises(UsageError, match=r"output_shape \[13, 13\] is larger than .* \[11, 11\]"):
        import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))


def test_auto_pad_that_is_not_an_onnx_value_is_refused_naming_it() -> None:
    model, feeds = _one_node("MaxPool", [("x", _f(3, 1, 3, 7, 8))], {"auto_pad": "SAME", "kernel_shape": [3, 3]}, 13)
    with pytest.raises(UsageError, match=r"auto_pad='SAME' is not an ONNX auto_pad; expected NOTSET, VALID"):
        import_onnx(model)(*(torch.from_numpy(v) for v in feeds.values()))


# --- LayerNormalization and ReduceMean --------------------------------------------------------------------------
@pytest.mark.parametrize("scale_shape", [(5,), (1, 5), (4, 1), (1,), (3, 1, 1)])
@pytest.mark.parametrize("axis", [-1, -2, 1])
def test_layernorm_scale_and_bias_broadcast_like_onnxruntime(scale_shape: tuple[int, ...], axis: int) -> None:
    """A scale smaller than the normalized shape (the spec broadcasts it) failed with torch's "Expected weight to be
    of same shape as normalized_shape"."""
    x = _f(6, 2, 3, 4, 5)
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=axis)
    _check_all(_model([node], {"x": x}, ["y"], {"s": _f(7, *scale_shape), "b": _f(8, *scale_shape)}), {"x": x})


@pytest.mark.parametrize("axis", [-1, 2])
@pytest.mark.parametrize("dtype_tol", [(np.float32, TOL), (np.float16, 2e-3)], ids=["fp32", "fp16"])
def test_layernorm_mean_and_inv_std_dev_outputs_match_onnxruntime(axis: int, dtype_tol: tuple) -> None:
    """They were refused ("its output 1 ('mean') is read by the graph"); both come out in float32 (stash_type 1)
    with the normalized axes kept as ones, for a float16 input too. Tolerance: fp16 output, 2e-3."""
    dtype, tol = dtype_tol
    x = _f(9, 2, 3, 4, 5).astype(dtype)
    shape = x.shape[axis % 4:]
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=axis, epsilon=1e-3)
    _check_all(_model([node], {"x": x}, ["y", "mean", "inv"], {"s": _f(10, *shape).astype(dtype),
                                                                "b": _f(11, *shape).astype(dtype)}), {"x": x}, tol)


def test_layernorm_inv_std_dev_only_feeding_the_graph_matches_onnxruntime() -> None:
    """Mean left out (""), InvStdDev read by a later node."""
    x = _f(12, 2, 6)
    nodes = [helper.make_node("LayerNormalization", ["x", "s"], ["y", "", "inv"]),
             helper.make_node("Mul", ["y", "inv"], ["z"])]
    _check_all(_model(nodes, {"x": x}, ["z"], {"s": _f(13, 6)}), {"x": x})


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("opset", [13, 18])
def test_reducemean_of_integers_truncates_like_onnxruntime(dtype: type, opset: int) -> None:
    """It failed ("mean(): could not infer output dtype"); ONNX Runtime divides the sum by the count, truncating
    toward zero in the input's type (the mean of [-7, 2, 3] is 0, not -1)."""
    x = np.array([[-7, 2, 3], [4, 5, 7], [-1, -1, 0]], dtype)
    if opset >= 18:
        _check(*_one_node("ReduceMean", [("x", x), ("c_axes", np.array([1], np.int64))], {"keepdims": 0}, opset))
    else:
        _check(*_one_node("ReduceMean", [("x", x)], {"axes": [1], "keepdims": 1}, opset))
        _check(*_one_node("ReduceMean", [("x", x)], {"keepdims": 0}, opset))  # all axes


# --- Constants, local functions, refusals -----------------------------------------------------------------------
@pytest.mark.parametrize("indices", [np.array([1, 6], np.int64), np.array([[0, 1], [1, 2]], np.int64)],
                         ids=["linear", "coordinates"])
def test_constant_sparse_value_matches_onnxruntime(indices: np.ndarray) -> None:
    """It was refused ("unsupported attribute ['sparse_value']")."""
    sp = helper.make_sparse_tensor(numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "v"),
                                   numpy_helper.from_array(indices, "i"), [2, 4])
    nodes = [helper.make_node("Constant", [], ["c"], sparse_value=sp), helper.make_node("Add", ["x", "c"], ["y"])]
    _check_all(_model(nodes, {"x": _f(14, 2, 4)}, ["y"], {}, 13), {"x": _f(14, 2, 4)})


def test_model_local_function_is_inlined_and_matches_onnxruntime() -> None:
    """A node calling a function the model defines (export_modules_as_functions, onnxscript) was refused as an
    unsupported operator."""
    n = helper.make_node
    fn = helper.make_function("my.custom", "ScaledTanh", ["a"], ["b"],
                              [n("Constant", [], ["k"], value_float=2.0), n("Mul", ["a", "k"], ["m"]),
                               n("Tanh", ["m"], ["b"])], opset_imports=[helper.make_opsetid("", 13)])
    model = _model([n("ScaledTanh", ["x"], ["t"], domain="my.custom"), n("Relu", ["t"], ["y"])], {"x": _f(15, 2, 4)},
                   ["y"], {}, 13, ("my.custom",))
    model.functions.append(fn)
    _check_all(model, {"x": _f(15, 2, 4)})


@pytest.mark.parametrize("domain_op_match", [
    ("ai.onnx.ml", "LinearRegressor",
     r"ai\.onnx\.ml::LinearRegressor \(node 'n'\) .* classical-ML .* --backend onnxruntime"),
    ("com.microsoft", "Attention",
     r"com\.microsoft::Attention \(node 'n'\) .* ONNX Runtime's own fusions.*not the float fused attention"),
    ("", "FastGelu", r"FastGelu \(node 'n'\) is not an operator of the ONNX standard.*build from the model as "
                     r"exported"),
], ids=["ml", "microsoft", "ort_default_domain"])
def test_other_runtimes_operators_are_refused_naming_the_fix(domain_op_match: tuple[str, str, str]) -> None:
    domain, op, match = domain_op_match
    node = helper.make_node(op, ["x"], ["y"], name="n", domain=domain)
    model = _model([node], {"x": _f(16, 2, 4)}, ["y"], {}, 13, (domain,) if domain else ())
    with pytest.raises(UsageError, match=match):
        import_onnx(model)


def test_string_constant_is_refused_naming_the_fix() -> None:
    nodes = [helper.make_node("Constant", [], ["c"], name="label", value_string="cat"),
             helper.make_node("Relu", ["x"], ["y"])]
    with pytest.raises(UsageError, match=r"Constant node 'label': attribute \['value_string'\] .*\(string constants"):
        import_onnx(_model(nodes, {"x": _f(17, 2)}, ["y"], {}, 13))


def test_external_data_is_read_from_the_model_folder_and_refused_clearly_unloaded(tmp_path, monkeypatch) -> None:
    """The path form reads weights.bin beside the model from any working folder; bytes or a ModelProto loaded
    without its data failed inside onnx ("should be stored in weights.bin, but it is not regular file")."""
    w, b = _f(18, 16, 8), _f(19, 8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    model = _model(nodes, {"x": _f(20, 2, 16)}, ["y"], {"w": w, "b": b}, 13)
    (tmp_path / "models").mkdir()
    path = tmp_path / "models" / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    monkeypatch.chdir(tmp_path)
    x = _f(20, 2, 16)
    np.testing.assert_allclose(import_onnx(path)(torch.from_numpy(x)).numpy(), x @ w + b, rtol=TOL, atol=TOL)
    for unloaded in (path.read_bytes(), onnx.load(str(path), load_external_data=False)):
        with pytest.raises(UsageError, match=r"initializers \['w', 'b'\] are stored in external data .* pass the "
                                             r"model's path"):
            import_onnx(unloaded)
