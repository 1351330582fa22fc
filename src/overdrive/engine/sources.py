"""Where a model comes from: an nn.Module, an ONNX file, TorchScript, a torch.export archive, or a
``pkg.module:factory`` string; and the two forms the backends need (a module, or ONNX bytes)."""

from __future__ import annotations

import inspect
import io
import os
import pickle
import re
import threading
import types
import warnings
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.files import quiet_fds, require_file
from overdrive._utils.inputs import ByName as _ByName
from overdrive._utils.inputs import is_token_model, takes_names
from overdrive._utils.optional import require
from overdrive._utils.trees import tensor_leaves
from overdrive.engine.config import ShapeProfile
from overdrive.engine.export_dims import _dynamic_shapes
from overdrive.engine.input_dtypes import INTEGER_INPUTS, integer_dtypes, module_input_dtypes, torchscript_inputs

_ONNX_FLOAT = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64, 7: torch.int64,
               6: torch.int32, 5: torch.int16, 3: torch.int8, 2: torch.uint8, 9: torch.bool}  # ONNX elem_type -> torch


def by_name(module: nn.Module, names: list[str]) -> nn.Module:
    """``module`` wrapped to take its inputs by name when every name is a parameter of its forward (and there is
    more than one input, or the one is not forward's first positional parameter: a T5 encoder given only
    ``inputs_embeds``), else ``module`` itself.

    Example:
        >>> # torch.onnx.export(by_name(bert, ["input_ids", "attention_mask"]), (ids, mask), ...)
    """
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return module
    if not all(n in params for n in names):
        return module
    first = next((n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    if len(names) < 2 and "use_cache" not in params and names == [first]:
        return module
    # a Hugging Face decoder would return its key/value cache, which neither exporter nor engine takes
    w = _ByName(module, names, {"use_cache": False} if "use_cache" in params else None)
    w.train(module.training)  # the exporters put the wrapper's mode back on the module afterwards
    return w




@dataclass
class ModelSource:
    """A model plus what we know of its inputs. Exactly one of ``module`` / ``onnx_bytes`` is set."""

    module: nn.Module | None = None
    onnx_bytes: bytes | None = None
    input_names: list[str] = field(default_factory=list)
    input_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    onnx_shapes: dict[str, list[int | None]] = field(default_factory=dict)  # None: dynamic dim
    onnx_dim_params: dict[str, list[str | None]] = field(default_factory=dict)  # an ONNX input's named dims
    onnx_output_names: list[str] = field(default_factory=list)  # an ONNX model's own output names
    kind: str = "module"  # module | onnx | torchscript | exported

    def as_module(self) -> nn.Module:
        """The model as an ``nn.Module`` (ONNX goes through overdrive's importer)."""
        if self.module is not None:
            return self.module
        from overdrive.engine.onnx import import_onnx

        return import_onnx(self.onnx_bytes)

    def as_onnx(self, example: tuple[torch.Tensor, ...], profiles: list[ShapeProfile], opset: int = 18) -> bytes:
        """The model as ONNX bytes (exported from the module with the profiles' dynamic dims)."""
        if self.onnx_bytes is not None:
            return self.onnx_bytes
        require("onnx", "onnx", "ONNX export")
        dynamic = any(not p.static for p in profiles)
        # The TorchScript exporter first: ~10x faster than the dynamo exporter on CPU (1.7 s vs 15 s for the
        # digits CNN here) and mature for CNNs and BERT-style encoders; the dynamo exporter when it fails.
        try:
            import warnings

            axes = {p.name: {d: f"{p.name}_d{d}" for d in p.dynamic_dims()} for p in profiles} if dynamic else None
            buf = io.BytesIO()
            wrapped = by_name(self.module, self.input_names)
            modes = [(mod, mod.training) for mod in self.module.modules()]
            # the exporter puts the module it is given back in that module's mode, recursively: a by-name wrapper
            # made here is in training mode, which would leave the user's model training (dropout on) afterwards
            wrapped.train(self.module.training)
            try:
                with warnings.catch_warnings(), torch.no_grad(), quiet_fds():  # a failure prints the IR graph
                    warnings.simplefilter("ignore")
                    torch.onnx.export(wrapped, example, buf, dynamo=False,
                                      input_names=self.input_names, dynamic_axes=axes, opset_version=min(opset, 17))
            finally:
                for mod, mode in modes:
                    mod.training = mode
            if not dynamic or _reproduces(buf.getvalue(), wrapped, example, profiles, self.input_names):
                return buf.getvalue()
        except Exception:  # noqa: BLE001 - fall through to the dynamo exporter, which raises its own error
            pass
        require("onnxscript", "onnx", "ONNX export")
        dyn = _dynamic_shapes(profiles, self.input_names) if dynamic else None
        wrapped = by_name(self.module, self.input_names)
        if dyn is not None and isinstance(wrapped, _ByName):  # forward(*xs): the inputs are one tuple argument
            dyn = (dyn,)
        try:
            with torch.no_grad():
                prog = torch.onnx.export(wrapped, example, dynamo=True,
                                         input_names=self.input_names, dynamic_shapes=dyn, opset_version=opset,
                                         verbose=False)
        except Exception as exc:  # noqa: BLE001 - both exporters failed: the model's own error, in one line
            why = export_summary(exc)
            fix = ("the model fixes a dim the shape profile lets vary (Python code on a size, such as a loop over the "
                   "sequence): make that dim static in the profile (--shapes), or change the model"
                   if "inferred a static shape" in why or "Constraints violated" in why else
                   "check --shapes against what the model takes, or build with --backend inductor")
            raise OverdriveError(f"the model could not be exported to ONNX with these inputs: {why}; {fix}") from exc
        data = prog.model_proto.SerializeToString()
        if dynamic and not _reproduces(data, wrapped, example, profiles, self.input_names):
            raise UsageError("the model's ONNX export does not compute what the model does across the shape profile "
                             "(checked at its min and max shapes: Python code branches or loops on a size, and the "
                             "export kept one branch); make those dims static in --shapes, build one engine per "
                             "range, or use --backend inductor, which refuses a profile the model does not hold for")
        return data


def _probe_shapes(shape: tuple[int, ...], p: ShapeProfile) -> list[tuple[int, ...]]:
    """Shapes to check an export at: :func:`_probe_shape`'s, and the profile's max (a branch on a size taken only
    above the traced one: a batch past 4 doubled the output, and a probe at the min did not see it).

    Example:
        >>> _probe_shapes((4, 8, 16), ShapeProfile("x", (1, 8, 16), (4, 8, 16), (8, 32, 16)))
        [(1, 9, 16), (8, 32, 16)]
    """
    first = _probe_shape(shape, p)
    return [first] + ([tuple(p.max)] if tuple(p.max) not in (first, tuple(shape)) else [])


def _probe_shape(shape: tuple[int, ...], p: ShapeProfile) -> tuple[int, ...]:
    """A shape inside ``p`` that differs from the traced ``shape`` in every dim the profile lets vary.

    Example:
        >>> _probe_shape((4, 8, 16), ShapeProfile("x", (1, 8, 16), (4, 8, 16), (8, 32, 16)))
        (1, 9, 16)
    """
    return tuple(n if lo == hi else lo if lo != n else min(n + 1, hi) for n, lo, hi in zip(shape, p.min, p.max))


def _reproduces(onnx_bytes: bytes, module: nn.Module, example: tuple[torch.Tensor, ...], profiles: list[ShapeProfile],
                names: list[str]) -> bool:
    """Whether a TorchScript-exported ONNX model computes what ``module`` does at a shape other than the traced one in
    every dynamic dim (tolerance 1e-3 of the output's range). The TorchScript exporter traces Python control flow on
    sizes at the example's sizes: a loop over the sequence ran that many steps at every size, wrong with no error
    (an LSTM-style cell at T=12 from a trace at T=8: 1.3 off). True where ONNX Runtime is absent (nothing to run)."""
    by = {p.name: p for p in profiles}
    probes = [_probe_shapes(tuple(x.shape), by[n]) if n in by else [tuple(x.shape)] for n, x in zip(names, example)]
    rounds = max(len(p) for p in probes)
    for i in range(rounds):  # the i-th probe of every input together (the last one where an input has fewer)
        shapes = [p[min(i, len(p) - 1)] for p in probes]
        if not _reproduces_at(onnx_bytes, module, example, shapes):
            return False
    return True


def _reproduces_at(onnx_bytes: bytes, module: nn.Module, example: tuple[torch.Tensor, ...],
                   shapes: list[tuple[int, ...]]) -> bool:
    """:func:`_reproduces` at one set of input shapes."""
    from overdrive._utils.optional import is_available

    g = torch.Generator().manual_seed(0)
    # floats from N(0, 1); integer and bool inputs all ones (a mask attending to every token, ids in any table)
    xs = tuple((torch.randn(s, generator=g) if x.is_floating_point() else torch.ones(s)).to(x.device, x.dtype)
               for s, x in zip(shapes, example))
    if not is_available("onnxruntime") or all(a.shape == b.shape for a, b in zip(xs, example)):
        return True
    import onnxruntime as ort

    try:
        with torch.no_grad():  # a user's @dataclass output too, in field order (pytree's tree_leaves skipped it)
            ref = tensor_leaves(module(*xs))
        so = ort.SessionOptions()
        so.log_severity_level = 4  # a failed run is an answer here, not an error for the terminal
        sess = ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
        outs = sess.run(None, {i.name: x.detach().cpu().numpy() for i, x in zip(sess.get_inputs(), xs)})
    except Exception:  # noqa: BLE001 - the export cannot run at that shape (a Gather past the traced size)
        return False
    if len(outs) != len(ref):
        return False
    for o, r in zip(outs, ref):
        o, r = torch.from_numpy(o).double(), r.detach().cpu().double()
        scale = float(r.abs().nan_to_num(0.0, 0.0, 0.0).max()) if r.numel() else 0.0
        if o.shape != r.shape or not torch.allclose(o, r, rtol=1e-3, atol=1e-3 * max(1.0, scale), equal_nan=True):
            return False
    return True


def export_summary(exc: BaseException) -> str:
    """The cause of a failed ONNX export, without the exporter's advice around it: torch's TorchExportError
    wraps the model's own error (a wrong shape, an unsupported op) in ~700 characters of next steps.

    Example:
        >>> export_summary(RuntimeError("Failed ... ## Exception summary <class 'RuntimeError'>: Given groups=1, "
        ...                             "expected 3 channels (Refer to the full stack trace above for more information.)"))
        'RuntimeError: Given groups=1, expected 3 channels'
        >>> export_summary(RuntimeError("The following operation failed in the TorchScript interpreter.\\n  File code.py"
        ...                             "\\nRuntimeError: expected input to have 3 channels\\n"))
        'RuntimeError: expected input to have 3 channels'
    """
    raw = str(exc)
    if "TorchScript interpreter" in raw:  # a TorchScript traceback (code and Python frames), the error on its last line
        last = [ln.strip() for ln in raw.splitlines() if ln.strip()][-1]
        if re.match(r"\w+(Error|Exception): ", last):
            return last[:300]
    text = " ".join(raw.split())
    m = re.search(r"## Exception summary\s*<class '(?:[\w.]+\.)?(\w+)'>:\s*(.*?)\s*(?:\(Refer to the full stack trace.*)?$", text)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc and len(text) > 300:
        return export_summary(cause)
    return f"{type(exc).__name__}: {text[:300]}"


def _not_onnx_hint(data: bytes) -> str:
    """What a file given as ONNX holds instead, and the flag that takes it, told from its first bytes: a PyTorch
    archive (``torch.save``, TorchScript and ``torch.export`` files are zip archives), a bare pickle, an engine file.

    Example:
        >>> _not_onnx_hint(b"PK\x03\x04...")[:40]
        '; it is a zip archive, as PyTorch saves '
    """
    if data[:4] == b"PK\x03\x04":
        return ("; it is a zip archive, as PyTorch saves (torch.save, TorchScript, torch.export): give a torch.export "
                "archive as --exported, TorchScript as --torchscript, and a model's code as --model file.py:factory "
                "(a state_dict or a pickled model is no model to build from on its own)")
    if data[:1] == b"\x80":
        return ("; it is a Python pickle (torch.save of an old format): build from the model's code with --model "
                "file.py:factory")
    if data[:8] == b"ODENGINE":
        return "; it is an overdrive engine already: run it with exec --loadEngine (or Engine.load)"
    return ""


def from_module(module: nn.Module, input_names: list[str] | None = None) -> ModelSource:
    """A module source: its inputs named as ``forward`` names its required positional parameters (``input_names``
    overrides). A TorchScript module (``torch.jit.load`` / ``script`` / ``trace``) has no Python signature: its
    inputs are named and typed from its graph (:func:`torchscript_inputs`), so shape profiles can name them.

    Example:
        >>> class Lookup(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = nn.Embedding(10, 4)
        ...     def forward(self, x, ids):
        ...         return self.emb(ids).sum(1) + x
        >>> src = from_module(torch.jit.script(Lookup()))
        >>> src.input_names, src.input_dtypes["ids"]
        (['x', 'ids'], torch.int64)
    """
    if isinstance(module, torch.jit.ScriptModule) and input_names is None:
        inputs = torchscript_inputs(module)
        return ModelSource(module=module, input_names=[n for n, _ in inputs],
                           input_dtypes={n: dt for n, dt in inputs if not dt.is_floating_point}, kind="torchscript")
    fwd = getattr(module, "forward", module)
    if input_names is None and is_token_model(module):
        input_names = ["input_ids", "attention_mask"] if takes_names(module, ["attention_mask"]) else ["input_ids"]
    if input_names is None:
        try:
            params = [p for p in inspect.signature(fwd).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
            input_names = [p.name for p in params] or ["input"]
        except (TypeError, ValueError):
            input_names = ["input"]
    names = list(input_names)
    return ModelSource(module=module, input_names=names, input_dtypes=integer_dtypes(names), kind="module")


def float32_source(src: ModelSource) -> tuple[ModelSource, torch.dtype | None]:
    """A module source whose floating weights and buffers are float32, and the dtype they had (None when they were
    float32 already, or the source is no Python module). An engine computes in float32 or the build precision: an
    fp64 (or fp16) model's weights met float32 inputs and failed in every backend ("Input type (float) and bias type
    (double) should be the same"; ONNX Runtime has no float64 Conv). The user's model is not changed (a copy).

    Example:
        >>> src, was = float32_source(from_module(nn.Linear(2, 2).double()))
        >>> was, src.module.weight.dtype
        (torch.float64, torch.float32)
    """
    m = src.module
    if m is None or isinstance(m, torch.jit.ScriptModule):
        return src, None
    dts = {t.dtype for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()}
    other = sorted((d for d in dts if d != torch.float32), key=str)
    if not other:
        return src, None
    import copy

    return replace(src, module=copy.deepcopy(m).float()), other[0]


def with_forward_dtypes(src: ModelSource) -> ModelSource:
    """A module source whose inputs that index or mask get int64 / bool (:func:`module_input_dtypes`), for a build
    that makes its own inputs from shapes. Only there: tracing runs the user's ``forward`` on ``torch.fx`` proxies,
    which a build given example inputs has no reason to do. A dtype the source states already (calibration data's)
    is kept unless it is float or the name rule's guess.

    Example:
        >>> class Lookup(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = nn.Embedding(10, 4)
        ...     def forward(self, tokens):
        ...         return self.emb(tokens)
        >>> with_forward_dtypes(from_module(Lookup())).input_dtypes
        {'tokens': torch.int64}
    """
    if src.module is None:
        return src
    traced = module_input_dtypes(src.module, src.input_names)
    keep = {n: d for n, d in traced.items()
            if src.input_dtypes.get(n, torch.float32).is_floating_point or n in INTEGER_INPUTS}
    return replace(src, input_dtypes={**src.input_dtypes, **keep}) if keep else src


def fit_input_names(src: ModelSource, n: int) -> ModelSource:
    """A module source whose inputs are named for the ``n`` example inputs a user gave: a Hugging Face model called as
    ``model(input_ids)`` (its attention_mask optional) takes one input, not the two it is built with by default; a
    ``forward(x, mask=None)`` given two takes both. Unchanged when the signature cannot name ``n`` inputs (then the
    build says how many it takes).

    Example:
        >>> class Net(nn.Module):
        ...     def forward(self, x, mask=None):
        ...         return x
        >>> fit_input_names(from_module(Net()), 2).input_names
        ['x', 'mask']
    """
    from overdrive._utils.inputs import default_input_names

    names = default_input_names(src.module, n) if src.module is not None else None
    if names is None:
        return src
    return replace(src, input_names=names, input_dtypes=integer_dtypes(names))


def external_data_names(proto: Any) -> list[str]:
    """The initializers of an ONNX ModelProto whose values live in external files.

    Example:
        >>> external_data_names(type("M", (), {"graph": type("G", (), {"initializer": []})()})())
        []
    """
    return [t.name for t in proto.graph.initializer if getattr(t, "data_location", 0) == 1]  # TensorProto.EXTERNAL


def from_onnx(model: str | Path | bytes | Any) -> ModelSource:
    onnx = require("onnx", "onnx", "building from ONNX")
    if isinstance(model, (str, Path)):
        require_file(model, "ONNX file")
        data = Path(model).read_bytes()
    elif isinstance(model, (bytes, bytearray)):
        data = bytes(model)
    else:
        data = model.SerializeToString()
    try:
        proto = onnx.load_from_string(data)
    except Exception as exc:
        raise UsageError(f"{model if isinstance(model, (str, Path)) else 'ONNX bytes'}: not a valid ONNX model "
                         f"({exc}){_not_onnx_hint(data)}") from exc
    if external_data_names(proto):
        if not isinstance(model, (str, Path)):
            raise UsageError(f"ONNX bytes reference external data files ({', '.join(external_data_names(proto)[:3])}); "
                             "they would be read from the current folder: pass the model's path instead")
        proto = onnx.load(str(model), load_external_data=True)  # from the model's own folder, not the current one
        try:
            data = proto.SerializeToString()
        except ValueError as exc:  # protobuf's 2 GB limit
            raise UsageError(f"{model}: with its external data the model is over 2 GB, more than one engine section "
                             "holds; build from a torch.export archive (.pt2) instead") from exc
    inits = {t.name for t in proto.graph.initializer}
    names, dtypes, shapes, params = [], {}, {}, {}
    for i in proto.graph.input:
        if i.name in inits:
            continue
        names.append(i.name)
        tt = i.type.tensor_type
        dtypes[i.name] = _ONNX_FLOAT.get(tt.elem_type, torch.float32)
        shapes[i.name] = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        params[i.name] = [d.dim_param if d.HasField("dim_param") and d.dim_param else None for d in tt.shape.dim]
    return ModelSource(onnx_bytes=data, input_names=names, input_dtypes=dtypes, onnx_shapes=shapes,
                       onnx_dim_params=params,
                       onnx_output_names=[o.name for o in proto.graph.output], kind="onnx")


def from_factory(spec: str) -> ModelSource:
    """``pkg.module:factory`` or ``file.py:factory`` -> the module the factory returns (called with no arguments).

    Example:
        >>> from_factory("torch.nn:Identity").kind
        'module'
    """
    from overdrive._utils.model_spec import load_factory

    return from_module(load_factory(spec).eval())


def from_torchscript(path: str | Path, profiles: list[ShapeProfile], seed: int = 0) -> ModelSource:
    """TorchScript goes through ONNX (the TorchScript exporter), like trtexec's workflow, at the profiles' opt shapes.

    The inputs are the profiles in the order of the module's forward when they name its parameters (``--shapes
    attention_mask:..,input_ids:..`` binds by name), else in the order given; their dtypes come from
    :func:`torchscript_inputs` (token ids and gather indices int64, masks bool).
    """
    require_file(path, "TorchScript file")
    try:
        scripted = torch.jit.load(str(path), map_location="cpu").eval()
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError with the archive's C++ trace
        raise UsageError(f"{path}: not a loadable TorchScript file ({export_summary(exc)}); save it with "
                         "torch.jit.save(torch.jit.trace(model, example), path)") from exc
    inputs = torchscript_inputs(scripted)
    names = [n for n, _ in inputs]
    if len(profiles) != len(inputs):
        raise UsageError(f"TorchScript {path} takes {len(inputs)} input(s) {names}, but the shapes name "
                         f"{len(profiles)}: {[p.name for p in profiles]}; give one shape per input, e.g. --shapes "
                         + ",".join(f"{n}:{'x'.join(map(str, profiles[0].opt)) if profiles else 'AxB'}" for n in names))
    if {p.name for p in profiles} == set(names):
        by = {p.name: p for p in profiles}
        profiles = [by[n] for n in names]
    g = torch.Generator().manual_seed(seed)
    # the export only traces: any valid values do (index 0 is in every table, a mask of ones keeps every position)
    example = tuple(torch.randn(p.opt, generator=g) if dt.is_floating_point else torch.ones(p.opt, dtype=dt)
                    if dt == torch.bool else torch.zeros(p.opt, dtype=dt) for p, (_, dt) in zip(profiles, inputs))
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings(), torch.no_grad(), quiet_fds():  # a failure prints the TorchScript IR graph
            warnings.simplefilter("ignore")
            torch.onnx.export(scripted, example, buf, dynamo=False, input_names=[p.name for p in profiles],
                              opset_version=17)
    except Exception as exc:  # noqa: BLE001 - the exporter's own error, in one line
        given = ", ".join(f"{p.name} {'x'.join(map(str, p.opt))} {str(x.dtype).replace('torch.', '')}"
                          for p, x in zip(profiles, example))
        raise OverdriveError(f"TorchScript {path} could not be exported to ONNX with inputs {given}: "
                             f"{export_summary(exc)}; check --shapes against what the model takes, or export it to "
                             "ONNX yourself (torch.onnx.export with real example inputs) and build with --onnx") from exc
    src = from_onnx(buf.getvalue())
    src.kind = "torchscript"
    src.onnx_output_names = []  # the exporter's numbered names: the header says output / outputN instead
    return src


_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_force_lock = threading.Lock()


def save_exported(ep: Any) -> bytes:
    """``torch.export.save`` into bytes, without its "No complete tensor found in the group!" warning for weights
    that are not contiguous. torch's packager counts a channels_last weight (every convolution weight of a CUDA
    engine) as a slice of a larger tensor, warns, and stores the tensor whole anyway; the loaded weights are equal
    (tested), so a user sees no warning about them.

    Example:
        >>> ep = torch.export.export(nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last), (torch.randn(1, 3, 8, 8),))
        >>> len(save_exported(ep)) > 0
        True
    """
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No complete tensor found in the group")
        torch.export.save(ep, buf)
    return buf.getvalue()


def load_exported(f: str | Path | bytes, what: str = "exported program") -> Any:
    """``torch.export.load`` that never runs a full unpickle.

    torch.export.load reads weights with ``weights_only=True`` but falls back to ``weights_only=False`` (any
    pickle, any code) for weights it marks as pickled and for archives in older formats. Here every torch.load
    inside it is forced to the weights-only unpickler (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``), so a crafted
    archive raises instead of running.

    Example:
        >>> # ep = load_exported(engine.sections["exported_program"], "engine section exported_program")
    """
    src = io.BytesIO(f) if isinstance(f, (bytes, bytearray)) else str(f)
    with _force_lock:
        old = os.environ.get(_FORCE)
        os.environ[_FORCE] = "1"
        try:
            with warnings.catch_warnings():  # torch reads the weights of an archive in memory with frombuffer over
                # our read-only bytes and warns that they are not writable; an engine never writes its weights
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return torch.export.load(src)
        except pickle.UnpicklingError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            detail = next((ln for ln in lines if "Unsupported" in ln or "GLOBAL" in ln), lines[0] if lines else "")
            raise UsageError(f"{what}: it holds pickled objects other than tensors, which overdrive refuses to "
                             f"unpickle (they could run code): {detail[:200]}; export the model again with "
                             "torch.export.save, with tensor weights only") from exc
        except (RuntimeError, ValueError, KeyError, EOFError, OSError, zipfile.BadZipFile) as exc:
            if isinstance(exc, zipfile.BadZipFile) or "zip" in str(exc).lower() or "deserializ" in str(exc).lower():
                raise UsageError(f"{what}: not a readable torch.export archive ({type(exc).__name__}: "
                                 f"{str(exc)[:200]}); save it again with torch.export.save") from exc
            raise
        finally:
            if old is None:
                os.environ.pop(_FORCE, None)
            else:
                os.environ[_FORCE] = old


class _Positional(nn.Module):
    """A ``torch.export`` module exported with positional inputs, called with them positionally."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.module(*xs)


def from_exported(path: str | Path) -> ModelSource:
    require_file(path, "exported program")
    ep = load_exported(path, f"exported program {path}")
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    module = ep.module()
    # torch.export's module refuses train()/eval() (NotImplementedError), which the ONNX exporters and the by-name
    # wrapper of a multi-input model call: `--exported` of a two-input archive failed with that error. Its graph is
    # fixed at export, so the mode is a flag only here; it is set to eval, as an engine runs (training mode made the
    # TorchScript exporter warn that the model was exported in training mode)
    module.train = types.MethodType(nn.Module.train, module)
    module.eval = types.MethodType(nn.Module.eval, module)
    module.eval()
    kwargs = (getattr(ep, "example_inputs", None) or ((), {}))[1]
    # exported with positional inputs, it takes them so only (by name: "kwarg keyword mismatch"); the wrapper's
    # forward(*xs) keeps the by-name wrapper of multi-input models (by_name) away from it
    src = from_module(module if kwargs else _Positional(module), names)
    src.kind = "exported"
    return src


def to_source(model: Any, input_names: list[str] | None = None) -> ModelSource:
    """Anything ``Builder.build`` accepts -> a :class:`ModelSource`."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, nn.Module):
        return from_module(model, input_names)
    if isinstance(model, (bytes, bytearray)):
        return from_onnx(model)
    if isinstance(model, (str, Path)):
        s = str(model)
        if s.endswith(".onnx"):
            return from_onnx(s)
        if s.endswith(".pt2"):
            return from_exported(s)
        if ":" in s and not Path(s).exists():
            return from_factory(s)
        raise UsageError(f"model {s!r}: expected a .onnx or .pt2 file, or pkg.module:factory")
    if type(model).__name__ == "ModelProto":
        return from_onnx(model)
    raise UsageError(f"cannot build from {type(model).__name__}; pass an nn.Module, an ONNX model/path, or a .pt2 path")
