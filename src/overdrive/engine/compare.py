"""Compare two runnables output by output, like polygraphy: max absolute and relative error and
PASSED/FAILED against ``|a - b| <= atol + rtol * |b|`` elementwise."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.config import shapes_arg
from overdrive.engine.format import model_file_kind


class _OrtReference:
    """An ONNX file run as-is by ONNX Runtime's CPU provider (the reference polygraphy uses)."""

    def __init__(self, model: str | bytes) -> None:
        from overdrive._utils.optional import require

        ort = require("onnxruntime", "onnx", "comparing against ONNX")
        if isinstance(model, str) and not Path(model).is_file():
            raise UsageError(f"ONNX file {model!r} does not exist")
        so = ort.SessionOptions()
        # basic optimizations only: the model's arithmetic as written. At ORT_ENABLE_ALL, ONNX Runtime 1.32 drops a
        # ReLU before an fp8 QuantizeLinear (ReluQuantRewrite): half the output range off on a small fp8 model
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT raises its own classes: INVALID_PROTOBUF, INVALID_GRAPH, ...
            what = repr(model) if isinstance(model, str) else "the in-memory ONNX model"
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "INVALID_PROTOBUF" in detail:  # ORT's status code and its own text say no more than this
                detail = "not a valid ONNX protobuf: truncated, or not an ONNX file"
            else:
                detail = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", detail)
            raise UsageError(f"ONNX file {what} cannot be loaded by ONNX Runtime ({detail[:300]}); is it a whole "
                             ".onnx model? export or download it again") from exc

    _TYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
              "tensor(int64)": torch.int64, "tensor(int32)": torch.int32, "tensor(int16)": torch.int16,
              "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool}

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        feeds = {}
        for i, x in zip(self.session.get_inputs(), xs):  # each input in the type the ONNX model declares (an
            dt = self._TYPES.get(i.type)  # engine with fp16 I/O bindings hands out fp16 inputs)
            fixed = [d if isinstance(d, int) else None for d in i.shape]
            if len(fixed) != x.dim() or any(f is not None and f != n for f, n in zip(fixed, x.shape)):
                want = "x".join("?" if f is None else str(f) for f in fixed)
                raise UsageError(f"the ONNX model's input {i.name!r} is fixed at {want}, but the comparison runs "
                                 f"{'x'.join(map(str, x.shape))}; "
                                 "export the ONNX model with that batch or a dynamic one, or compare at its shape")
            feeds[i.name] = (x.to(dt) if dt is not None else x).contiguous().cpu().numpy()
        return [torch.from_numpy(o) for o in self.session.run(None, feeds)]


def _runnable(x: Any) -> tuple[Any, str]:
    """An Engine, an engine path, an ONNX model (path, bytes or ModelProto; run with ONNX Runtime) or an
    nn.Module -> (callable, label)."""
    from overdrive.engine.runtime import Engine

    if isinstance(x, Engine):
        return x, f"engine({x.header['backend']}, {x.header['precision']})"
    if isinstance(x, torch.nn.Module):
        return x, f"pytorch({type(x).__name__})"
    if isinstance(x, (bytes, bytearray)) or hasattr(x, "SerializeToString"):  # ONNX bytes or an onnx.ModelProto
        data = bytes(x) if isinstance(x, (bytes, bytearray)) else x.SerializeToString()
        return _OrtReference(data), "onnxruntime(<in-memory model>)"
    p = str(x)
    kind = model_file_kind(p) if Path(p).is_file() else None
    if p.endswith(".onnx") or kind == "onnx":
        return _OrtReference(p), f"onnxruntime({Path(p).name})"
    if kind == "torchscript":  # torch.jit.save's archive (what `build --torchscript` reads): TorchScript, no pickle
        try:
            return torch.jit.load(p, map_location="cpu").eval(), f"torchscript({Path(p).name})"
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError with the archive's C++ trace
            raise UsageError(f"cannot compare {p!r}: not a loadable TorchScript file "
                             f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); "
                             "save it with torch.jit.save(torch.jit.trace(model, example), path)") from exc
    if kind == "exported":
        from overdrive.engine.sources import from_exported

        return from_exported(p).module, f"exported({Path(p).name})"
    if kind == "torch.save" or (p.endswith((".pt", ".pth")) and Path(p).is_file()):  # a model pickle or weights
        raise UsageError(f"cannot compare {p!r}: a torch.save file is not an engine, and overdrive does not unpickle "
                         "models (loading a pickle runs code); compare 'file.py:factory' (build it with its weights "
                         "there), an engine built with `overdrive build --model file.py:factory --checkpoint ...`, a "
                         "TorchScript file (torch.jit.save) or an .onnx file")
    if Path(p).is_file():
        return Engine.load(p), f"engine({Path(p).name})"
    if ":" in p:
        from overdrive.engine.sources import from_factory

        return from_factory(p).module, f"pytorch({p})"
    raise UsageError(f"cannot compare {p!r}: expected an engine file, an .onnx file, pkg.module:factory or file.py:factory")


def _wide(o: torch.Tensor) -> torch.Tensor:
    """Float outputs as float32; integer outputs as float64, which holds them exactly up to 2**53 (float32 only
    to 2**24: token ids or indices 1 apart compared equal there)."""
    return o.cpu().double() if not (o.is_floating_point() or o.is_complex()) else o.float().cpu()


def _outputs(fn: Any, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    from overdrive.engine.runtime import Engine
    from overdrive.engine.backends.prepare import flatten_outputs

    if isinstance(fn, Engine):
        return [_wide(o) for o in fn.run(*xs)]
    if isinstance(fn, _OrtReference):
        return [_wide(o) for o in fn(*xs)]
    with torch.no_grad():
        p = next(fn.parameters(), None)
        dev, dt = (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.float32)
        xs = tuple(x.to(dev, dt) if x.is_floating_point() else x.to(dev) for x in xs)  # the module's own float type
        return [_wide(o) for o in flatten_outputs(fn(*xs))]


def _names(fn: Any, n: int) -> list[str] | None:
    """The output names an engine's header or an ONNX model gives, when there are ``n`` of them."""
    from overdrive.engine.runtime import Engine

    if isinstance(fn, Engine):
        names = [o["name"] for o in fn.header["outputs"]]
    elif isinstance(fn, _OrtReference):
        names = [o.name for o in fn.session.get_outputs()]
    else:
        return None
    return names if len(names) == n else None


def load_inputs(path: str) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
    """``compare --inputs FILE``: a ``.npz`` of named arrays, or a ``.pt`` read with
    ``torch.load(weights_only=True)`` (a data file never runs code) holding a tensor, a list/tuple of tensors
    (in input order) or a dict of input name -> tensor.

    Example:
        >>> # torch.save({"input": torch.randn(4, 1, 8, 8)}, "in.pt"); load_inputs("in.pt")["input"].shape
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--inputs {path!r} does not exist; give a .pt (torch.save of a tensor, a list of tensors or "
                         "a dict name -> tensor) or an .npz of named arrays")
    try:
        if p.suffix == ".npz":
            import numpy as np

            with np.load(p, allow_pickle=False) as z:
                data: Any = {k: torch.from_numpy(z[k]) for k in z.files}
        else:
            data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a torn zip, a pickle of code, an object array
        raise UsageError(f"--inputs {path}: cannot read it ({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); "
                         "expected a .pt of tensors (torch.save) or an .npz of named arrays") from exc
    if isinstance(data, torch.Tensor):
        return (data,)
    if isinstance(data, (list, tuple)) and data and all(isinstance(x, torch.Tensor) for x in data):
        return tuple(data)
    if isinstance(data, dict) and data and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()):
        return dict(data)
    raise UsageError(f"--inputs {path} holds a {type(data).__name__}, not tensors; save a tensor, a list of tensors "
                     "or a dict of input name -> tensor")


def _input_specs(fa: Any, fb: Any) -> list[tuple[str, list[int | None], torch.dtype]] | None:
    """(name, shape with None for a dynamic dim, dtype) of each input, from an engine or an ONNX model."""
    from overdrive.engine.runtime import Engine

    for f in (fa, fb):
        if isinstance(f, Engine):
            return [(p.name, list(p.opt), dt) for p, dt in zip(f.profiles, f.input_dtypes)]
    for f in (fa, fb):
        if isinstance(f, _OrtReference):
            return [(i.name, [d if isinstance(d, int) else None for d in i.shape],
                     _OrtReference._TYPES.get(i.type, torch.float32)) for i in f.session.get_inputs()]
    return None


def _input_names(fn: Any) -> list[str] | None:
    """The input names of an engine or an ONNX model, in the order it takes them (None for a PyTorch model)."""
    from overdrive.engine.runtime import Engine

    if isinstance(fn, Engine):
        return list(fn.input_names)
    if isinstance(fn, _OrtReference):
        return [i.name for i in fn.session.get_inputs()]
    return None


def _for(fn: Any, label: str, inputs: tuple[torch.Tensor, ...], fa: Any, fb: Any) -> tuple[torch.Tensor, ...]:
    """``inputs`` (in the order of the side :func:`_input_specs` reads: the engine's, else the first ONNX model's,
    else A's) as ``fn`` takes them: by name where both sides name them (an ONNX model may order x, y as y, x).
    Refuses another number of inputs: it fed only the first ones to an ONNX model and compared unrelated outputs."""
    from overdrive.engine.runtime import Engine

    have = _input_names(fn)
    if have is None:  # a PyTorch model: refuse another number of inputs by name, not with forward's TypeError
        try:
            inspect.signature(fn.forward).bind(*inputs)
        except TypeError as exc:
            raise UsageError(f"{label} cannot take the {len(inputs)} input(s) of the other side ({exc}): compare two "
                             "models that take the same inputs") from exc
        except (ValueError, AttributeError):  # no signature Python can read: the call says
            pass
        # by name where forward names the other side's inputs (an ONNX model may declare a, b as b, a): by position
        # a model computing 2a + b "PASSED" against one computing 2b + a, and failed against its own export
        sides = [f for f in (fa, fb) if isinstance(f, Engine)] + [f for f in (fa, fb) if isinstance(f, _OrtReference)]
        order = _input_names(sides[0]) if sides else None
        try:
            params = [n for n, q in inspect.signature(fn.forward).parameters.items()
                      if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)][:len(inputs)]
        except (ValueError, AttributeError, TypeError):
            params = []
        if order and len(order) == len(inputs) and order != params and sorted(order) == sorted(params):
            return tuple(inputs[order.index(n)] for n in params)
        return inputs
    if len(have) != len(inputs):
        raise UsageError(f"{label} takes {len(have)} input(s) {have}, but the other side takes {len(inputs)}: "
                         "compare two models that take the same inputs")
    sides = [f for f in (fa, fb) if isinstance(f, Engine)] + [f for f in (fa, fb) if isinstance(f, _OrtReference)]
    order = _input_names(sides[0]) if sides else None
    if order and order != have and sorted(order) == sorted(have):
        return tuple(inputs[order.index(n)] for n in have)
    return inputs


def _make_inputs(fa: Any, fb: Any, shapes: dict[str, tuple[int, ...]] | None,
                 named: dict[str, torch.Tensor] | None, seed: int) -> tuple[torch.Tensor, ...]:
    """The inputs both sides run: ``named`` tensors or random ones at ``shapes`` (default: an engine's opt
    shapes or an ONNX model's fixed shapes), in the order of the engine's / ONNX model's inputs."""
    from overdrive.engine.inputs import random_input
    from overdrive.engine.runtime import Engine

    specs = _input_specs(fa, fb)
    given = named if named is not None else shapes or {}
    flag = "--inputs" if named is not None else "--shapes"
    if specs is None:  # two PyTorch models: the order given
        if not given:
            raise UsageError("compare needs --shapes (name:1x3x8x8,...) or --inputs FILE when neither side is an "
                             "engine or an ONNX model (which give the input names and shapes)")
        if named is not None:
            return tuple(named.values())
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(s, generator=g) for s in given.values())
    names = [n for n, _, _ in specs]
    unknown = sorted(set(given) - set(names))
    if unknown:  # a misspelt name would otherwise run silently at the default shape
        raise UsageError(f"{flag} names input {', '.join(map(repr, unknown))}, which the model does not have; its "
                         f"inputs are {', '.join(map(repr, names))}")
    eng = fa if isinstance(fa, Engine) else fb if isinstance(fb, Engine) else None
    if named is None and eng is not None:
        return eng.random_inputs(shapes or None, seed=seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape, dt in specs:
        if named is not None:
            if name not in named:
                raise UsageError(f"--inputs has no tensor {name!r}; it holds {', '.join(map(repr, named))} and the "
                                 f"model's inputs are {', '.join(map(repr, names))}")
            out.append(named[name])
            continue
        s = given.get(name)
        if s is None:
            if any(d is None for d in shape):
                raise UsageError(f"input {name!r} has dynamic dims ({'x'.join('?' if d is None else str(d) for d in shape)}); "
                                 f"give its shape, e.g. --shapes "
                                 f"{shapes_arg({name: 'x'.join('1' if d is None else str(d) for d in shape)})}")
            s = tuple(shape)  # type: ignore[arg-type]
        out.append(random_input(name, tuple(s), dt, g).to(dt))
    return tuple(out)


def compare(a: Any, b: Any, inputs: Any = None, atol: float = 1e-3, rtol: float = 1e-3, seed: int = 0,
            shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Run ``a`` and ``b`` on the same inputs; ``b`` is the reference for relative error. ``inputs``: a tuple of
    tensors in input order, a dict of input name -> tensor, or a file :func:`load_inputs` reads; else random
    inputs at ``shapes`` ({name: shape}; default: an engine's opt shapes or an ONNX model's fixed shapes).

    Example:
        >>> # r = compare("model_fp16.engine", "model.onnx", atol=1e-2); r["passed"]
        >>> # r = compare("a.onnx", "b.onnx", shapes={"input": (4, 1, 8, 8)})
    """
    if not (0 <= atol < float("inf") and 0 <= rtol < float("inf")):  # NaN fails too
        # an infinite atol passes inf against a finite value, an infinite rtol fails where the reference is 0 (inf * 0)
        raise UsageError(f"--atol {atol:g} / --rtol {rtol:g}: tolerances must be finite and >= 0 (for example "
                         "--atol 1e-3 --rtol 1e-3; a large finite value such as 1e30 where any difference is fine)")
    if inputs is not None and shapes:
        raise UsageError("give --inputs or --shapes, not both (the inputs' own shapes are the ones run)")
    if isinstance(inputs, (str, Path)):
        inputs = load_inputs(str(inputs))
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    fa, la = _runnable(a)
    fb, lb = _runnable(b)
    if inputs is None or isinstance(inputs, dict):
        inputs = _make_inputs(fa, fb, shapes, inputs, seed)
    inputs = tuple(inputs)
    oa, ob = _outputs(fa, _for(fa, la, inputs, fa, fb)), _outputs(fb, _for(fb, lb, inputs, fa, fb))
    if len(oa) != len(ob):
        raise UsageError(f"{la} has {len(oa)} outputs but {lb} has {len(ob)}")
    names = _names(fa, len(oa)) or _names(fb, len(oa)) or [f"output{i}" for i in range(len(oa))]
    rows = []
    for i, (x, y) in enumerate(zip(oa, ob)):
        if x.shape != y.shape:  # a mismatch, as polygraphy's: FAILED (exit 1), not a usage error
            rows.append({"output": i, "name": names[i], "shape": list(x.shape), "shape_b": list(y.shape),
                         "max_abs": None, "mean_abs": None, "max_rel": None, "median_rel": None, "min_atol": None,
                         "passed": False})
            continue
        # equal values (infinities included: inf - inf is NaN) differ by 0; a NaN on either side fails, as in
        # torch.allclose
        if x.dtype != y.dtype:  # an integer output on one side only: compare both in float64
            x, y = x.double(), y.double()
        diff = torch.where(x == y, torch.zeros_like(x), (x - y).abs())
        finite_ref = torch.where(torch.isinf(y), torch.zeros_like(y), y.abs())
        rel = diff / finite_ref.clamp_min(1e-12)
        ok = bool((diff <= atol + rtol * finite_ref).all())
        # polygraphy's "minimum required tolerance": the smallest atol that passes at this rtol (NaN: none does)
        need = (diff - rtol * finite_ref).clamp_min(0)
        if diff.numel() == 0:  # an empty output (NonZero of nothing) on both sides: nothing differs
            diff = rel = need = torch.zeros(1, dtype=diff.dtype)
        rows.append({"output": i, "name": names[i], "shape": list(x.shape), "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
                     "max_rel": float(rel.max()), "median_rel": float(rel.median()), "min_atol": float(need.max()),
                     "passed": ok})
    failed = [r["name"] for r in rows if not r["passed"]]
    return {"a": la, "b": lb, "atol": atol, "rtol": rtol, "outputs": rows, "mismatched_outputs": failed,
            "passed": not failed}


def format_compare(r: dict[str, Any]) -> str:
    """The report as text: one line per output, then polygraphy's verdict lines (``PASSED | All outputs matched |
    Outputs: [...]`` or ``FAILED | Mismatched outputs: [...]``, failures tagged ``[E]``) and the overall one.

    Example:
        >>> o = {"output": 0, "name": "y", "shape": [2], "max_abs": 0.5, "mean_abs": 0.25, "max_rel": 0.5,
        ...      "median_rel": 0.25, "min_atol": 0.5, "passed": False}
        >>> print(format_compare({"a": "A", "b": "B", "atol": 0.1, "rtol": 0.0, "outputs": [o], "passed": False}).splitlines()[-2])
        [E] FAILED | Mismatched outputs: ['y']
    """
    lines = [f"[I] Comparing {r['a']} vs {r['b']} (atol={r['atol']:g}, rtol={r['rtol']:g}: an element passes when "
             f"|a - b| <= atol + rtol * |b|)"]
    for o in r["outputs"]:
        tag, verdict = ("[I]", "PASSED") if o["passed"] else ("[E]", "FAILED")
        if o.get("shape_b") is not None:
            lines.append(f"{tag}   output {o['output']} {o.get('name', '')!r}: shape {tuple(o['shape'])} vs "
                         f"{tuple(o['shape_b'])} -> {verdict} (outputs of different shapes are not compared)")
            continue
        need = f", min atol {o['min_atol']:.4g} at this rtol" if o.get("min_atol") is not None else ""
        lines.append(f"{tag}   output {o['output']} {o.get('name', '')!r} {tuple(o['shape'])}: max abs {o['max_abs']:.4g}, mean abs {o['mean_abs']:.4g}, "
                     f"max rel {o['max_rel']:.4g}, median rel {o['median_rel']:.4g}{need} -> {verdict}")
    names = [o.get("name", f"output{o['output']}") for o in r["outputs"]]
    bad = [o.get("name", f"output{o['output']}") for o in r["outputs"] if not o["passed"]]
    lines.append(f"[I] PASSED | All outputs matched | Outputs: {names}" if not bad else
                 f"[E] FAILED | Mismatched outputs: {bad}")
    lines.append(f"{'[I] PASSED' if r['passed'] else '[E] FAILED'} | {r['a']} vs {r['b']}")
    return "\n".join(lines)
