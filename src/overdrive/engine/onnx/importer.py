"""ONNX -> PyTorch: run an ONNX graph as an ``nn.Module`` so Inductor can compile it on the GPU.

ONNX Runtime on the GPU machine has only its CPU provider, and onnx2torch (the best known importer)
is unmaintained and has no QuantizeLinear/DequantizeLinear, so overdrive carries its own importer for
the operators common CNNs and transformers export to, Q/DQ included. ``forward`` walks the nodes in
order; ``torch.export`` traces that walk into one flat graph.

Shape arithmetic (Shape -> Gather -> Concat -> Reshape) stays on the host: small integer constants and
the outputs of Shape are numpy arrays (object arrays of SymInts under dynamic export), so no
data-dependent ``.tolist()`` reaches the traced graph.

The operators are in ``ops.py`` (elementwise and math), ``shape.py`` (shape and tensor manipulation, Split
included), ``layers.py`` (MatMul, Gemm, Conv, pools, norms, Softmax), ``qdq.py`` (Q/DQ), ``integer.py`` (the
integer ops of ONNX Runtime's quantization tool; its com.microsoft QLinear* ones in ``qlinear.py``, and those its
optimizer fuses in ``qfused.py``), ``rnn.py``
(LSTM/GRU/RNN), ``contrib.py`` (ONNX Runtime's own Gelu family, Skip/SimplifiedLayerNormalization and
FusedConv, which its transformer optimizer writes), ``select.py`` (TopK/ArgMax/ArgMin, the Reduce family, Einsum,
the gathers and scatters, OneHot, DepthToSpace, Resize), ``vision.py`` (GridSample, RoiAlign) and ``dynamic.py`` (Compress, Unique), the value
conversions in ``values.py``; the operator table is assembled here from them all, so no operator module imports
another or this one.

Example:
    >>> "Conv" in SUPPORTED_OPS and "QuantizeLinear" in SUPPORTED_OPS and "Split" in SUPPORTED_OPS
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx import contrib, dynamic, integer, layers, ops, qdq, rnn, select, shape, vision
from overdrive.engine.onnx.shape import _split
from overdrive.engine.onnx.values import _ML_DTYPES, FOUR_BIT, Op, Value, _as_value, _from_numpy, _tensor

__all__ = ["ONNXModule", "SUPPORTED_OPS", "SUPPORTED_CONTRIB_OPS", "import_onnx"]

# op name -> function; Constant and Split are handled below
_OPS: dict[str, Op] = {**ops.OPS, **shape.OPS, **layers.OPS, **qdq.OPS, **integer.OPS, **rnn.OPS, **select.OPS,
                       **vision.OPS, **dynamic.OPS}
HOST_INPUTS = {**ops.HOST_INPUTS, **rnn.HOST_INPUTS, **select.HOST_INPUTS, **dynamic.HOST_INPUTS}  # inputs read as Python numbers, by op and position
SUPPORTED_OPS = tuple(sorted([*_OPS, "Constant", "Split"]))
# ONNX Runtime's own operators the importer runs (contrib.py), keyed "domain::op" in the run table
MS = "com.microsoft"
_RUN: dict[str, Op] = {**_OPS, **{f"{MS}::{k}": f for k, f in contrib.OPS.items()},
                       **contrib.DEFAULT_DOMAIN_OPS}
SUPPORTED_CONTRIB_OPS = tuple(sorted(f"{MS}::{k}" for k in contrib.OPS))


# operator domains other exporters write, with what each holds and the fix
_DOMAINS = {
    "ai.onnx.ml": "the ai.onnx.ml domain holds classical-ML operators (skl2onnx, onnxmltools: tree ensembles, "
                  "linear models, scalers), which the importer, built for neural-network graphs, does not run; "
                  "use --backend onnxruntime",
    "com.microsoft": "com.microsoft operators are ONNX Runtime's own fusions, written by its graph optimizer (a model "
                     "saved with SessionOptions.optimized_model_filepath at level EXTENDED or ALL) or by "
                     "onnxruntime.transformers.optimizer; " + contrib.REFUSED_HINT + "; build from the model as "
                     "exported, before those optimizations (Inductor fuses the same patterns itself), or use "
                     "--backend onnxruntime",
}


def _sparse_to_numpy(sp: Any) -> np.ndarray:
    """A SparseTensorProto (a Constant's ``sparse_value``) as a dense array: its indices are [NNZ] linear
    positions or [NNZ, rank] coordinates into ``dims``; elements not listed are zero."""
    from onnx import numpy_helper

    vals, idx = numpy_helper.to_array(sp.values), numpy_helper.to_array(sp.indices).astype(np.int64)
    dense = np.zeros(tuple(sp.dims), vals.dtype)
    if idx.ndim == 2:
        idx = np.ravel_multi_index(tuple(idx.T), dense.shape)
    dense.reshape(-1)[idx] = vals
    return dense


def _run_key(node: Any) -> str | None:
    """The run-table key of an ONNX Runtime operator the importer runs ("com.microsoft::Gelu"; the op's own name for
    the ones ONNX Runtime writes in the default domain, SimplifiedLayerNormalization), else None."""
    if node.domain == MS and node.op_type in contrib.OPS:
        return f"{MS}::{node.op_type}"
    if node.domain in ("", "ai.onnx") and node.op_type in contrib.DEFAULT_DOMAIN_OPS and node.op_type not in _OPS:
        return node.op_type
    return None


class ONNXModule(nn.Module):
    """An ONNX graph as a module: ``forward(*inputs)`` in the graph's input order.

    Example:
        >>> # mod = ONNXModule(onnx.load("model.onnx")); y = mod(torch.randn(1, 3, 224, 224))
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        from onnx import defs, helper, numpy_helper

        # model-local functions (export_modules_as_functions, onnxscript) are made of standard operators: inlined,
        # the graph is one the importer runs
        if len(model.functions):
            from onnx import inliner

            model = inliner.inline_local_functions(model)
        g = model.graph
        for node in g.node:
            if node.domain in ("", "ai.onnx") and node.op_type in dynamic.REFUSED:
                raise UsageError(f"ONNX operator {node.op_type} (node {node.name or '<unnamed>'!r}) is not supported by "
                                 f"overdrive's ONNX importer: {dynamic.REFUSED[node.op_type]}")
            key = _run_key(node)
            if key is not None:
                lo, hi, names = contrib.ARITY[node.op_type]
                if not lo <= len(node.input) <= hi:
                    raise UsageError(f"ONNX node {node.name or '<unnamed>'!r} ({key}) has "
                                     f"{len(node.input)} inputs; expected {lo} to {hi} ({names}); the model is "
                                     "malformed: re-run the optimizer that wrote it, or use --backend onnxruntime")
                continue
            if node.domain in _DOMAINS:
                raise UsageError(f"ONNX operator {node.domain}::{node.op_type} (node {node.name or '<unnamed>'!r}) is "
                                 f"not supported by overdrive's ONNX importer: {_DOMAINS[node.domain]}")
            if node.domain in ("", "ai.onnx") and not defs.has(node.op_type):
                raise UsageError(f"ONNX operator {node.op_type} (node {node.name or '<unnamed>'!r}) is not an operator "
                                 "of the ONNX standard but a runtime's own extension in the default domain (ONNX "
                                 "Runtime's optimizer writes its own operators there); build from the model "
                                 "as exported, before a runtime's optimizations, or use --backend onnxruntime")
            if node.domain not in ("", "ai.onnx") or (node.op_type not in _OPS and node.op_type not in ("Constant", "Split")):
                raise UsageError(
                    f"ONNX operator {node.domain + '::' if node.domain else ''}{node.op_type} (node {node.name or '<unnamed>'!r}) "
                    "is not supported by overdrive's ONNX importer; use --backend onnxruntime on CPU, re-export the model "
                    "without it, or build from the PyTorch model (--model pkg.module:factory)")
        external = [t.name for t in g.initializer if t.data_location == 1]  # TensorProto.EXTERNAL, not yet read
        if external:
            raise UsageError(f"ONNX initializers {external[:3]} are stored in external data files that were not loaded "
                             "(ONNX bytes, or a model loaded with load_external_data=False); pass the model's path to "
                             "import_onnx (its data is read from the model's own folder), or onnx.load(path) it first")
        self.input_names = [i.name for i in g.input if i.name not in {t.name for t in g.initializer}]
        # the default-domain opset: a few ops (Softmax before 13) changed meaning between opsets
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
        self.output_names = [o.name for o in g.output]
        self._host: dict[str, np.ndarray] = {}  # small constants (shapes, axes, scalars): folded at trace time
        self._buffers_by_value: dict[str, str] = {}
        # inputs read as Python numbers (Resize's scales and sizes): a buffer would be a fake tensor under export
        host_args = {n.input[i] for n in g.node for i in HOST_INPUTS.get(n.op_type, ()) if i < len(n.input)}
        dq_data = {n.input[0] for n in g.node if n.op_type == "DequantizeLinear"}
        # a QuantizeLinear's 4-bit zero point stays a numpy array: its dtype is what says the output is 4-bit
        q_zps = {n.input[2] for n in g.node if n.op_type == "QuantizeLinear" and len(n.input) > 2}
        for i, t in enumerate(g.initializer):
            arr = numpy_helper.to_array(t)
            if arr.dtype.kind == "V" and arr.dtype.name not in FOUR_BIT and arr.dtype.name not in _ML_DTYPES:
                readers = [n.name or n.op_type for n in g.node if t.name in n.input]
                raise UsageError(f"ONNX initializer {t.name!r} (read by {readers}) has element type {arr.dtype.name}, "
                                 "which overdrive's importer cannot represent; build with --backend onnxruntime, or "
                                 "export the model with int8/uint8, int4/uint4 or float8 e4m3fn/e5m2 Q/DQ")
            # small integer constants, and one-element float ones (Q/DQ scales, epsilons) like Constant nodes':
            # kept on the host, they trace to literals (a 0-d float buffer, once frozen, broke Inductor's reshape)
            # but not the data of a DequantizeLinear (int32 biases): that is dequantized beside device tensors
            if ((arr.dtype.kind in "iub" and arr.size <= 64 and t.name not in dq_data)
                    or (arr.dtype.name in FOUR_BIT and t.name in q_zps)
                    or (arr.dtype.kind == "f" and arr.size == 1)
                    or (t.name in host_args and (arr.size <= 64 or arr.dtype.kind in "iub"))):
                self._host[t.name] = arr
            else:
                key = f"w{i}"
                self.register_buffer(key, _from_numpy(arr))
                self._buffers_by_value[t.name] = key
        self._nodes: list[tuple[str, list[str], list[str], dict[str, Any], str]] = []
        for node in g.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Constant":
                val = attrs.get("value")
                if val is not None:
                    arr = numpy_helper.to_array(val)
                elif "value_float" in attrs or "value_int" in attrs:
                    arr = np.array(attrs.get("value_float", attrs.get("value_int")))
                elif "value_floats" in attrs or "value_ints" in attrs:
                    arr = np.array(attrs.get("value_floats", attrs.get("value_ints")))
                elif "sparse_value" in attrs:
                    arr = _sparse_to_numpy(attrs["sparse_value"])
                else:
                    raise UsageError(f"Constant node {node.name!r}: attribute {list(attrs)} is not supported by the "
                                     "importer (string constants have no tensor form); expected value, value_float(s), "
                                     "value_int(s) or sparse_value; remove the string constant from the model, or "
                                     "use --backend onnxruntime")
                self._host[node.output[0]] = arr
                continue
            if node.op_type == "LayerNormalization" and any(node.output[1:]):  # Mean / InvStdDev listed
                attrs["_stats"] = True
            if "value" in attrs and hasattr(attrs["value"], "dims"):  # ConstantOfShape's tensor attribute
                attrs["value"] = numpy_helper.to_array(attrs["value"])
            self._nodes.append((_run_key(node) or node.op_type, list(node.input), list(node.output), attrs, node.name))

    def forward(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.input_names):
            raise UsageError(f"ONNX model takes {len(self.input_names)} inputs {self.input_names}, got {len(inputs)}")
        env: dict[str, Value] = dict(self._host)
        env.update({v: getattr(self, k) for v, k in self._buffers_by_value.items()})
        env.update(zip(self.input_names, inputs))
        env[""] = None
        for op, ins, outs, attrs, name in self._nodes:
            args = [env[i] for i in ins]
            try:
                if op == "Split":
                    res = _split(self, args, attrs, len(outs))
                else:  # the standard ops' table first: it is the one a test may patch
                    res = (_OPS.get(op) or _RUN[op])(self, args, attrs)
            except UsageError as exc:
                if name and repr(name) in str(exc):
                    raise
                # an operator's own refusal (a Resize mode, a Pad mode) names the node, so the user can find it
                raise UsageError(f"ONNX node {name or '<unnamed>'!r} ({op}): {exc}") from exc
            except Exception as exc:
                raise UsageError(f"ONNX node {name!r} ({op}) failed in the importer: {type(exc).__name__}: {exc}") from exc
            res = list(res)
            if len(res) < len(outs):  # an optional output the importer does not compute (MaxPool's Indices)
                read = {i for _, node_ins, _, _, _ in self._nodes for i in node_ins} | set(self.output_names)
                missing = [(k, o) for k, o in enumerate(outs) if k >= len(res) and o and o in read]
                if missing:
                    k, o = missing[0]
                    raise UsageError(f"ONNX node {name!r} ({op}): its output {k} ({o!r}) is read by the graph, and the "
                                     f"importer computes only the first {len(res)} of {op}'s outputs; build with "
                                     "--backend onnxruntime, or export the model without that output")
            env.update(zip(outs, (_as_value(r) for r in res)))
        outs = [_tensor(env[o]) for o in self.output_names]
        return outs[0] if len(outs) == 1 else tuple(outs)


def import_onnx(model_or_path: Any) -> ONNXModule:
    """Load an ONNX model (path, bytes or ModelProto) as an :class:`ONNXModule`.

    Example:
        >>> # mod = import_onnx("resnet50.onnx")
    """
    import onnx

    if isinstance(model_or_path, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(model_or_path))
    elif isinstance(model_or_path, onnx.ModelProto):
        model = model_or_path
    else:
        model = onnx.load(str(model_or_path))
    return ONNXModule(model)
