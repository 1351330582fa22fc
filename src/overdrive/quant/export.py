"""ONNX export with QuantizeLinear/DequantizeLinear pairs where TensorRT wants them.

Placement follows TensorRT's rules: Q/DQ on the inputs (activation and weight) of Conv,
ConvTranspose and Gemm/MatMul, never on their outputs, plus Q/DQ on the residual input of an add
(``QuantAdd``) so the add fuses into the preceding conv, and on both inputs of attention's
activation-by-activation MatMuls (``QuantMatmul``, ``QuantSDPA``; opt-in). Scales are symmetric (zero point 0),
weights per output channel (``axis``, hence opset >= 13). int8 uses the TorchScript exporter's
fake-quantize translation; fp8 e4m3 emits Q/DQ with a float8 zero point (opset >= 19).

Example:
    >>> # path = quant.export_onnx(model, (torch.randn(1, 1, 8, 8),), "model_int8.onnx")
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.files import atomic_path, atomic_write, quiet_fds
from overdrive._utils.inputs import ByName, default_input_names, forward_parameters, is_token_model, takes_names
from overdrive._utils.optional import require
from overdrive.quant.api import eval_mode, quantizers


def _check_ready(model: nn.Module) -> str:
    qs = [(n, q) for n, q in quantizers(model) if q.enabled]
    if not qs:
        raise UsageError("the model has no enabled quantizers; call quant.quantize(model, config, forward_loop) first")
    dynamic = [n for n, q in qs if q.dynamic]
    if dynamic:
        raise UsageError(f"quantizer(s) {dynamic[:5]} have dynamic per-token scales, which have no ONNX Q/DQ form "
                         "(QuantizeLinear takes a fixed scale); quantize with a static config (quant.INT8_DEFAULT, "
                         "calibrated) to export, or run the dynamic model through quant.to_real or an engine")
    formats = {q.config.format for _, q in qs}
    return "fp8_e4m3" if "fp8_e4m3" in formats else "int8"


def _refuse_uncalibrated(names: list[str]) -> UsageError:
    return UsageError(f"cannot export before calibration: quantizer(s) {names[:5]} have no amax; run "
                      "quant.quantize(model, config, forward_loop=...) or quant.calibrate(model, forward_loop)")


@contextlib.contextmanager
def _uncalibrated_reached(model: nn.Module) -> Iterator[list[str]]:
    """The enabled quantizers without an amax that the block's forward calls reach, in call order. Only those can
    stop the export: one the example forward never reaches (an auxiliary or training-only head) is not in the
    exported graph, so it needs no amax (as ModelOpt exports such a model)."""
    uncalibrated = {q: n for n, q in quantizers(model) if q.enabled and not q.is_calibrated}
    hit: list[str] = []

    def seen(q: nn.Module, _args: Any) -> None:
        if uncalibrated[q] not in hit:
            hit.append(uncalibrated[q])

    handles = [q.register_forward_pre_hook(seen) for q in uncalibrated]
    try:
        yield hit
    finally:
        for h in handles:
            h.remove()


def _max_opset() -> int | None:
    """The newest opset this torch's exporter accepts (None when torch does not say)."""
    try:
        from torch.onnx import _constants
    except ImportError:
        return None
    return getattr(_constants, "ONNX_MAX_OPSET", None)


def check_opset(opset: int | None, fmt: str) -> int:
    """The opset to export ``fmt`` ('int8' / 'fp8_e4m3') with: ``opset``, or 17 (int8) / 19 (fp8) when None.

    Raises UsageError for an opset that cannot express the Q/DQ nodes or that torch cannot write,
    so the CLI can refuse it before calibrating."""
    opset = opset or (19 if fmt == "fp8_e4m3" else 17)
    if opset < 13:
        raise UsageError(f"opset={opset} is too old: per-channel QuantizeLinear needs opset >= 13")
    if fmt == "fp8_e4m3" and opset < 19:
        raise UsageError(f"opset={opset} cannot express fp8 QuantizeLinear; use opset >= 19 for fp8 models")
    top = _max_opset()
    if top is not None and opset > top:
        raise UsageError(f"opset={opset} is newer than torch {torch.__version__}'s ONNX exporter writes (at most "
                         f"{top}); use an opset from {19 if fmt == 'fp8_e4m3' else 13} to {top}")
    return opset


def find_op_owner(model: nn.Module, example_inputs: tuple[Any, ...], op: str) -> str | None:
    """The name of the innermost module whose forward calls aten ``op`` (for error messages).

    The exporter names the aten op, which is often not the Python call's name: ``torch.special.i0`` is
    ``aten::i0``, ``F.interpolate(..., antialias=True)`` is ``aten::_upsample_bilinear2d_aa``, ``x[mask]`` is
    ``aten::index``. So the calls are watched at both levels: torch.* functions (composite ops the exporter
    sees whole, ``linalg_svdvals``) and the aten ops they dispatch to."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    stack: list[str] = []
    found: list[str] = []
    names = {m: n for n, m in model.named_modules()}
    want = op.strip("_")

    def seen(name: str) -> None:
        if not found and name and (name == op or name.strip("_") == want):
            found.append(stack[-1] if stack else "<root>")

    class _Watch(TorchFunctionMode):  # sees torch.* calls (torch.fft.fft is named 'fft_fft' there)
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            seen(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    class _WatchAten(TorchDispatchMode):  # sees the aten ops by the names the exporter gives them
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            schema = getattr(func, "_schema", None)
            seen(schema.name.split("::")[-1] if schema is not None else "")
            return func(*args, **(kwargs or {}))

    def enter(m: nn.Module, inputs: Any) -> None:
        if m in names:
            stack.append(names[m])

    def leave(m: nn.Module, inputs: Any, output: Any) -> None:  # must return None: a value replaces the output
        if m in names and stack:
            stack.pop()

    handles = [h for m in names for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.no_grad(), _Watch(), _WatchAten():
            model(*example_inputs)
    except Exception:  # noqa: BLE001 - best effort: only used to improve an error message
        pass
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def _named_example(model: nn.Module, example_inputs: Any,
                   input_names: Sequence[str] | None) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    """(names, tensors): a dict's keys, ``input_names``, the tokenizer's order for a token model
    (input_ids, attention_mask, token_type_ids), the forward's parameters for several inputs, else 'input'."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        if input_names is not None and list(input_names) != list(example_inputs):
            raise UsageError(f"input_names {list(input_names)} do not match the example dict's keys "
                             f"{list(example_inputs)}; give one or the other")
        names, xs = [str(k) for k in example_inputs], tuple(example_inputs.values())
    else:
        xs = tuple(example_inputs)
        if input_names is not None:
            names = list(input_names)
        elif len(xs) == 1 and not is_token_model(model):
            names = ["input"]
        else:
            names = default_input_names(model, len(xs)) or [f"input{i}" for i in range(len(xs))]
    if len(names) != len(xs) or len(set(names)) != len(names):
        raise UsageError(f"{len(xs)} example input(s) but input_names {names}; give one distinct name per input")
    if isinstance(example_inputs, Mapping) and len(xs) > 1 and not takes_names(model, names):
        raise UsageError(f"example inputs {names}: {type(model).__name__}.forward does not take all of them by name; "
                         "pass a tuple in forward's order instead of a dict")
    return names, xs


def _outputs(out: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor the exporter flattens ``out`` into: a ModelOutput's / dict's keys (logits,
    last_hidden_state, pooler_output), ``output`` for one tensor, ``output0``, ``output1`` ... for a tuple."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, Mapping):
        return [o for k, v in out.items() if v is not None for o in _outputs(v, str(k))]
    if isinstance(out, (tuple, list)):
        parts = [v for v in out if v is not None]
        if len(parts) == 1:
            return _outputs(parts[0], prefix)
        base = "output" if prefix == "output" else f"{prefix}."
        return [o for i, v in enumerate(parts) for o in _outputs(v, f"{base}{i}")]
    return []


def _auto_axes(names: list[str], xs: tuple[torch.Tensor, ...], out_names: list[str], outs: list[torch.Tensor],
               batch: bool) -> dict[str, dict[int, str]]:
    """Dynamic batch (dim 0 of every input and output) and sequence (dim 1 of integer inputs of rank >= 2,
    token ids and masks, and of rank >= 3 outputs whose dim 1 has the sequence's length)."""
    axes: dict[str, dict[int, str]] = {}
    seq = None
    for n, x in zip(names, xs):
        a = {0: "batch"} if batch and isinstance(x, torch.Tensor) and x.dim() >= 1 else {}
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and not x.is_floating_point() and not x.is_complex():
            a[1], seq = "sequence", x.shape[1]
        if a:
            axes[n] = a
    for n, o in zip(out_names, outs):
        a = {0: "batch"} if batch and o.dim() >= 1 else {}
        if seq is not None and o.dim() >= 3 and o.shape[1] == seq:
            a[1] = "sequence"
        if a:
            axes[n] = a
    return axes


def export_onnx(model: nn.Module, example_inputs: Any, path: str | Path, opset: int | None = None,
                input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
                dynamic_axes: Mapping[str, Any] | str | None = "auto", dynamic_batch: bool = True,
                check: bool = True) -> Path:
    """Export a calibrated fake-quant model to ONNX with Q/DQ nodes; returns the path.

    ``example_inputs``: a tensor, a tuple (in forward's order; for a token model, one whose forward takes
    ``input_ids``, the tokenizer's order input_ids, attention_mask, token_type_ids) with optional
    ``input_names``, or a dict of name -> tensor. The model is called by keyword whenever its forward takes
    every name, so a Hugging Face model (``BertModel``, ``GPT2Model``, ``...ForSequenceClassification``)
    exports as it is; one whose forward takes ``use_cache`` runs with ``use_cache=False`` (a KV cache is not a
    graph output). Input names default to the dict's keys, the names above, or ``input`` for one input;
    output names to the model output's keys (``last_hidden_state``, ``pooler_output``, ``logits``), else
    ``output`` / ``output0``, ``output1``, ...

    ``dynamic_axes``: ``"auto"`` (default) makes dim 0 of every input and output ``batch`` (unless
    ``dynamic_batch=False``) and dim 1 of integer inputs of rank >= 2 (token ids, masks) ``sequence``, with
    the matching dim of (batch, sequence, ...) outputs; a dict is passed to the exporter as it is
    (``{"input_ids": {0: "batch", 1: "sequence"}}``); None exports the example's shapes. Export with a
    sequence longer than 1 (a length-1 trace can fix broadcasts to it).

    ``opset`` defaults to 17 (int8) or 19 (fp8, the first opset with float8 Q/DQ). The model is
    exported in eval mode on its current device; ``onnx.checker`` runs when ``check``.

    Example:
        >>> # quant.export_onnx(model, (torch.randn(1, 3, 224, 224),), "resnet50_int8.onnx")
        >>> # quant.export_onnx(bert, {"input_ids": ids, "attention_mask": mask}, "bert_int8.onnx")
    """
    onnx = require("onnx", extra="onnx", feature="ONNX export")
    fmt = _check_ready(model)
    bf16 = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype == torch.bfloat16]
    if bf16:  # after qat(..., policy="O2"): a bf16 graph, which ONNX Runtime refuses to load (Conv, Gemm)
        raise UsageError(f"the model holds bfloat16 tensors ({bf16[0]}{' and more' if len(bf16) > 1 else ''}: after "
                         "qat(..., policy='O2') or .bfloat16()); export an fp32 copy: "
                         "quant.export_onnx(copy.deepcopy(model).float(), ...)")
    opset = check_opset(opset, fmt)
    names, xs = _named_example(model, example_inputs, input_names)
    params = forward_parameters(model) or {}
    extra = {"use_cache": False} if "use_cache" in params and "use_cache" not in names else {}
    traced: nn.Module = ByName(model, names, extra) if takes_names(model, names) else model
    with eval_mode(model), torch.no_grad():
        with _uncalibrated_reached(model) as uncalibrated:
            try:
                out = traced(*xs)
            except Exception as exc:  # noqa: BLE001 - name the call that failed before the exporter hides it
                if uncalibrated:  # it failed past a quantizer without amax: that is the cause
                    raise _refuse_uncalibrated(uncalibrated) from exc
                who = type(model.module if isinstance(model, ByName) else model).__name__
                raise UsageError(f"{who} does not run on the example inputs {names}: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
        if uncalibrated:
            raise _refuse_uncalibrated(uncalibrated)
    named = _outputs(out)
    flat = [t for _, t in named]
    outs = list(output_names) if output_names is not None else [n for n, _ in named]
    if dynamic_axes == "auto":
        dyn: Mapping[str, Any] | None = _auto_axes(names, xs, outs, flat, dynamic_batch) or None
    elif isinstance(dynamic_axes, str):
        raise UsageError(f"dynamic_axes={dynamic_axes!r}: give 'auto', None, or a dict such as "
                         "{'input_ids': {0: 'batch', 1: 'sequence'}}")
    else:
        dyn = dict(dynamic_axes) if dynamic_axes else None
        unknown = sorted(set(dyn or {}) - set(names) - set(outs))
        if unknown:
            raise UsageError(f"dynamic_axes names {unknown}, which are neither inputs {names} nor outputs {outs}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # a temporary file, renamed over path once whole: a failed or interrupted export leaves the old file
        with atomic_path(path) as tmp, eval_mode(model), torch.no_grad(), warnings.catch_warnings(), quiet_fds():
            warnings.simplefilter("ignore")  # quiet_fds: a failed export prints the whole IR
            torch.onnx.export(traced, xs, str(tmp), opset_version=opset, dynamo=False,
                              input_names=names, output_names=outs, dynamic_axes=dyn, do_constant_folding=True)
    except Exception as exc:  # noqa: BLE001 - turn exporter failures into a message naming op and module
        if _export_dynamo(model, traced, xs, path, opset, names, outs, dyn):
            _tidy_qdq(path)
            if check:
                onnx.checker.check_model(onnx.load(str(path)))
            return path
        msg = str(exc)
        m = re.search(r"aten::(\w+)", msg) or re.search(r"operator '?(\w+)'?", msg)
        if m is None:
            raise OverdriveError(f"ONNX export failed: {msg.splitlines()[0] if msg else type(exc).__name__}") from exc
        op = m.group(1)
        with eval_mode(model):  # as exported: no dropout, no BatchNorm statistics updates
            owner = find_op_owner(traced, xs, op)
        if owner is not None and traced is not model:
            owner = owner.removeprefix("module.").removeprefix("module") or "<root>"
        where = f" used in module '{owner}'" if owner is not None else ""  # not reached by the example forward
        raise OverdriveError(
            f"ONNX (opset {opset}) cannot express op '{op}'{where}: "
            f"{msg.splitlines()[0][:300]}; replace that op, keep the module out of the export, or try another opset"
        ) from exc
    if isinstance(traced, ByName):
        _strip_wrapper_prefix(path)
    _tidy_qdq(path)
    if check:
        onnx.checker.check_model(onnx.load(str(path)))
    return path


def _strip_wrapper_prefix(path: Path) -> None:
    """Name the exported weights as the model names them (``0.weight``), not through the by-name wrapper the
    export traced (``module.0.weight``): what reads weights from the file by name (a weight-sparsity check, a
    refit) finds them. A name whose short form is taken already keeps its prefix."""
    onnx = require("onnx", extra="onnx", feature="ONNX export")
    proto = onnx.load(str(path), load_external_data=False)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        return  # weights in files beside the model: their names are their files' names too
    graph = proto.graph
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input} | {v.name for v in graph.output}
    taken |= {o for n in graph.node for o in n.output}
    rename = {}
    for t in graph.initializer:
        short = t.name.removeprefix("module.")
        if short != t.name and short not in taken:
            rename[t.name] = short
            taken.add(short)
    if not rename:
        return
    for t in graph.initializer:
        t.name = rename.get(t.name, t.name)
    for v in list(graph.input) + list(graph.value_info):
        v.name = rename.get(v.name, v.name)
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]
    atomic_write(path, proto.SerializeToString())


def _tidy_qdq(path: Path) -> None:
    """Rewrite the exported file in place into the form TensorRT's explicit-quantization rules ask for.

    * A Linear applied to a (B, T, C) input is traced as ``W -> Q -> DQ -> Transpose -> MatMul``: an op between
      the weight's DequantizeLinear and the MatMul, which keeps TensorRT from fusing the Q/DQ into an int8 GEMM.
      The weight initializer is stored transposed, (in, out) as MatMul takes it, its Q/DQ scales along axis 1
      (still one per output channel), and the DQ feeds the MatMul directly; the values are the same.
    * Scales and zero points of Q/DQ written as Constant nodes become float32 / int8 (float8) initializers.

    Example:
        >>> # _tidy_qdq(Path("model_int8.onnx"))  # W(in, out) -> Q(axis=1) -> DQ(axis=1) -> MatMul
    """
    onnx = require("onnx", extra="onnx", feature="ONNX export")
    from onnx import numpy_helper

    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer):
        return  # weights in files beside the model: left as written
    inits = {t.name: t for t in graph.initializer}
    prod = {o: n for n in graph.node for o in n.output}
    users: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs = {v.name for v in graph.output}
    changed, dropped, stale = False, set(), set()

    def only_user(name: str, node: Any) -> bool:
        return name not in outputs and [id(u) for u in users.get(name, [])] == [id(node)]

    for t in [n for n in graph.node if n.op_type == "Transpose"]:
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), [1, 0])
        dq, readers = prod.get(t.input[0]), users.get(t.output[0], [])
        q = prod.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if (perm != [1, 0] or q is None or q.op_type != "QuantizeLinear" or q.input[0] not in inits
                or len(inits[q.input[0]].dims) != 2 or not readers or t.output[0] in outputs
                or any(r.op_type != "MatMul" or r.input[1] != t.output[0] for r in readers)
                or not only_user(dq.output[0], t) or not only_user(q.output[0], dq)
                or not only_user(q.input[0], q)):
            continue
        axes = [a for n in (q, dq) for a in n.attribute if a.name == "axis"]
        if any(a.i not in (0, -2) for a in axes):
            continue
        w = inits[q.input[0]]  # (out, in) -> (in, out); per-channel scales then run along axis 1
        w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).T.copy(), w.name))
        for a in axes:
            a.i = 1
        for r in readers:
            r.input[1] = dq.output[0]
        dropped.add(id(t))
        stale |= {w.name, q.output[0], dq.output[0], t.output[0]}
        changed = True
    for c in [n for n in graph.node if n.op_type == "Constant" and len(n.output) == 1]:
        name, readers = c.output[0], users.get(c.output[0], [])
        value = next((a.t for a in c.attribute if a.name == "value" and a.HasField("t")), None)
        if (value is None or not readers or name in outputs or name in inits
                or any(r.op_type not in ("QuantizeLinear", "DequantizeLinear") or r.input[0] == name for r in readers)):
            continue
        init = graph.initializer.add()
        init.CopyFrom(value)
        init.name = name
        dropped.add(id(c))
        changed = True
    if not changed:
        return
    kept = [n for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    kept_vi = [v for v in graph.value_info if v.name not in stale]  # shapes of the rewritten tensors are re-inferred
    del graph.value_info[:]
    graph.value_info.extend(kept_vi)
    for v in graph.input:
        if v.name in stale and v.name in inits:  # an initializer listed as an input: its new (in, out) shape
            dims = v.type.tensor_type.shape.dim
            if len(dims) == 2:
                a, b = dims[0].dim_value, dims[1].dim_value
                dims[0].dim_value, dims[1].dim_value = b, a
    atomic_write(path, proto.SerializeToString())


def _export_dynamo(model: nn.Module, traced: nn.Module, xs: tuple[torch.Tensor, ...], path: Path, opset: int,
                   names: list[str], outs: list[str], dyn: Mapping[str, Any] | None) -> bool:
    """The model exported with torch's torch.export-based ONNX exporter, where the TorchScript one cannot express an
    op (Llama's ``aten::diff`` in transformers 5's mask code): the quantizers write QuantizeLinear/DequantizeLinear
    there too (``TensorQuantizer._export_qdq``). Opset at least 18; the ``dynamic_axes`` dims become dynamic
    dims. True when it wrote ``path``; False (the caller reports the first exporter's error) when it failed too."""
    import importlib.util

    if importlib.util.find_spec("onnxscript") is None:  # the exporter's own dependency
        return False
    shapes = tuple({d: torch.export.Dim.DYNAMIC for d in (dyn or {}).get(n, {})} for n in names) if dyn else None
    if shapes is not None and isinstance(traced, ByName):  # forward(*xs): the inputs are one tuple argument
        shapes = (shapes,)
    onnx = require("onnx", extra="onnx", feature="ONNX export")
    try:
        for optimize in (True, False):
            with eval_mode(model), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prog = torch.onnx.export(traced, xs, dynamo=True, input_names=names, output_names=outs,
                                         dynamic_shapes=shapes, opset_version=max(opset, 18), verbose=False,
                                         optimize=optimize)
            proto = prog.model_proto
            if proto.ByteSize() >= 2**31:  # past protobuf's limit the checker cannot take it whole
                break
            try:  # its optimizer can leave a Clip reading a tensor no node makes (a Relu that feeds two narrow-range
                onnx.checker.check_model(proto)  # quantizers, folded into their clamps): then the graph unoptimized
                break
            except onnx.checker.ValidationError:
                if not optimize:
                    raise
        for inp in proto.graph.input:  # the dims by the names dynamic_axes gave them (batch, sequence), as before
            for d, label in (dyn or {}).get(inp.name, {}).items():
                dims = inp.type.tensor_type.shape.dim
                if d < len(dims) and dims[d].dim_param:
                    dims[d].dim_param = str(label)
        atomic_write(path, proto.SerializeToString())  # no half-written file where the model was
    except Exception:  # noqa: BLE001 - both exporters failed: the caller names the op the first one could not take
        return False
    return True


def qdq_counts(path: str | Path) -> dict[str, int]:
    """How many of each op type the exported graph has (tests and the CLI print this)."""
    onnx = require("onnx", extra="onnx", feature="ONNX inspection")
    counts: dict[str, int] = {}
    for node in onnx.load(str(path)).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
