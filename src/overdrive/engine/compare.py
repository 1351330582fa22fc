"""Compare two runnables output by output, like polygraphy: max absolute and relative error and
PASSED/FAILED against ``|a - b| <= atol + rtol * |b|`` elementwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from overdrive._utils.errors import UsageError


class _OrtReference:
    """An ONNX file run as-is by ONNX Runtime's CPU provider (the reference polygraphy uses)."""

    def __init__(self, model: str | bytes) -> None:
        from overdrive._utils.optional import require

        ort = require("onnxruntime", "onnx", "comparing against ONNX")
        if isinstance(model, str) and not Path(model).is_file():
            raise UsageError(f"ONNX file {model!r} does not exist")
        self.session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])

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
                                 f"{'x'.join(map(str, x.shape))} (the engine's opt shapes unless inputs are given); "
                                 "export the ONNX model with that batch or a dynamic one, or compare at its shape")
            feeds[i.name] = (x.to(dt) if dt is not None else x).contiguous().cpu().numpy()
        return [torch.from_numpy(o) for o in self.session.run(None, feeds)]


def _runnable(x: Any) -> tuple[Any, str]:
    """An Engine, an engine path, an ONNX model (path, bytes or ModelProto; run with ONNX Runtime) or an
    nn.Module -> (callable, label)."""
    from overdrive.engine.api import Engine

    if isinstance(x, Engine):
        return x, f"engine({x.header['backend']}, {x.header['precision']})"
    if isinstance(x, torch.nn.Module):
        return x, f"pytorch({type(x).__name__})"
    if isinstance(x, (bytes, bytearray)) or hasattr(x, "SerializeToString"):  # ONNX bytes or an onnx.ModelProto
        data = bytes(x) if isinstance(x, (bytes, bytearray)) else x.SerializeToString()
        return _OrtReference(data), "onnxruntime(<in-memory model>)"
    p = str(x)
    if p.endswith(".onnx"):
        return _OrtReference(p), f"onnxruntime({Path(p).name})"
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
    from overdrive.engine.api import Engine
    from overdrive.engine.backends.inductor import flatten_outputs

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
    from overdrive.engine.api import Engine

    if isinstance(fn, Engine):
        names = [o["name"] for o in fn.header["outputs"]]
    elif isinstance(fn, _OrtReference):
        names = [o.name for o in fn.session.get_outputs()]
    else:
        return None
    return names if len(names) == n else None


def compare(a: Any, b: Any, inputs: tuple[torch.Tensor, ...] | None = None, atol: float = 1e-3, rtol: float = 1e-3,
            seed: int = 0) -> dict[str, Any]:
    """Run ``a`` and ``b`` on the same inputs; ``b`` is the reference for relative error.

    Example:
        >>> # r = compare("model_fp16.engine", "model.onnx", atol=1e-2); r["passed"]
    """
    if not (atol >= 0 and rtol >= 0):  # NaN fails too
        raise UsageError(f"--atol {atol:g} / --rtol {rtol:g}: tolerances must be >= 0 (for example --atol 1e-3 --rtol 1e-3)")
    fa, la = _runnable(a)
    fb, lb = _runnable(b)
    if inputs is None:
        from overdrive.engine.api import Engine

        eng = fa if isinstance(fa, Engine) else fb if isinstance(fb, Engine) else None
        if eng is None:
            raise UsageError("compare needs inputs when neither side is an engine (its profile gives the shapes)")
        inputs = eng.random_inputs(seed=seed)
    oa, ob = _outputs(fa, inputs), _outputs(fb, inputs)
    if len(oa) != len(ob):
        raise UsageError(f"{la} has {len(oa)} outputs but {lb} has {len(ob)}")
    names = _names(fa, len(oa)) or _names(fb, len(oa)) or [f"output{i}" for i in range(len(oa))]
    rows = []
    for i, (x, y) in enumerate(zip(oa, ob)):
        if x.shape != y.shape:
            raise UsageError(f"output {i}: shape {tuple(x.shape)} from {la} vs {tuple(y.shape)} from {lb}")
        # equal values (infinities included: inf - inf is NaN) differ by 0; a NaN on either side fails, as in
        # torch.allclose
        if x.dtype != y.dtype:  # an integer output on one side only: compare both in float64
            x, y = x.double(), y.double()
        diff = torch.where(x == y, torch.zeros_like(x), (x - y).abs())
        finite_ref = torch.where(torch.isinf(y), torch.zeros_like(y), y.abs())
        rel = diff / finite_ref.clamp_min(1e-12)
        ok = bool((diff <= atol + rtol * finite_ref).all())
        if diff.numel() == 0:  # an empty output (NonZero of nothing) on both sides: nothing differs
            diff = rel = torch.zeros(1, dtype=diff.dtype)
        rows.append({"output": i, "name": names[i], "shape": list(x.shape), "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
                     "max_rel": float(rel.max()), "median_rel": float(rel.median()), "passed": ok})
    return {"a": la, "b": lb, "atol": atol, "rtol": rtol, "outputs": rows, "passed": all(r["passed"] for r in rows)}


def format_compare(r: dict[str, Any]) -> str:
    lines = [f"[I] Comparing {r['a']} vs {r['b']} (atol={r['atol']:g}, rtol={r['rtol']:g}: an element passes when "
             f"|a - b| <= atol + rtol * |b|)"]
    for o in r["outputs"]:
        lines.append(f"[I]   output {o['output']} {o.get('name', '')!r} {tuple(o['shape'])}: max abs {o['max_abs']:.4g}, mean abs {o['mean_abs']:.4g}, "
                     f"max rel {o['max_rel']:.4g}, median rel {o['median_rel']:.4g} -> {'PASSED' if o['passed'] else 'FAILED'}")
    lines.append(f"[I] {'PASSED' if r['passed'] else 'FAILED'} | {r['a']} vs {r['b']}")
    return "\n".join(lines)
