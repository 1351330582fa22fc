"""The public verbs: ``Builder(cfg).build(model) -> Engine``, ``Engine.save/load``, ``engine(*inputs)``,
``engine.benchmark()``, and ``compare(a, b)``."""

from __future__ import annotations

import platform
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from overdrive import __version__
from overdrive._utils.device import cpu_isa, resolve_device
from overdrive._utils.errors import UsageError
from overdrive._utils.files import atomic_write
from overdrive._utils.signing import signing_key
from overdrive.engine import accuracy, backends, format as fmt
from overdrive.engine import int8 as int8_mode
from overdrive.engine.config import IO_DTYPES, BuildConfig, ShapeProfile
from overdrive._utils.inputs import takes_names
from overdrive.engine.sources import ModelSource, integer_dtypes, to_source

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
       "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
       "bool": torch.bool}


def device_facts(device: torch.device) -> dict[str, Any]:
    """What an engine is tied to: GPU name + compute capability, or the CPU ISA."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "compute_capability": f"{p.major}.{p.minor}"}
    return {"type": "cpu", "isa": cpu_isa(), "machine": platform.machine()}


def describe_device(d: dict[str, Any]) -> str:
    """One line for an engine header's device record (what ``device_facts`` wrote).

    Example:
        >>> describe_device({"type": "cuda", "name": "NVIDIA H200", "compute_capability": "9.0"})
        'NVIDIA H200 (sm 9.0)'
    """
    return f"{d['name']} (sm {d['compute_capability']})" if d["type"] == "cuda" else f"CPU {d.get('machine')} {d.get('isa')}"


def choose_backend(requested: str, device: torch.device, precision: str, src: ModelSource) -> tuple[str, str]:
    """``auto`` -> the fastest backend usable here for this device and precision, with the reason."""
    if requested != "auto":
        why = backends.get(requested).unavailable(device)
        if why and requested != "tensorrt":
            raise UsageError(f"--backend {requested} is not usable on {device.type}: {why}")
        return requested, "asked for"
    if device.type == "cuda":
        return "inductor", "CUDA: Inductor kernels + CUDA graphs (ONNX Runtime here has no GPU provider)"
    ort_ok = backends.get("onnxruntime").unavailable(device) is None and precision in ("fp32", "tf32", "int8")
    if ort_ok:
        return "onnxruntime", "CPU fp32/int8: ONNX Runtime builds in seconds and runs small models faster than Inductor's C++"
    return "inductor", f"CPU {precision}: ONNX Runtime here runs fp32/int8 only"


def _has_qdq(onnx_bytes: bytes) -> bool:
    from overdrive.engine.backends.onnxruntime import has_qdq

    return has_qdq(onnx_bytes)


def _reference(src: ModelSource) -> tuple[accuracy.Reference, str]:
    """What an int8/fp8 engine built from ``src`` is compared with, and its label: the float model (``fp32``);
    for a model quantized already, that model as given (``qdq``: the Q/DQ ONNX model through ONNX Runtime,
    ``fake-quant``: a quantized PyTorch module)."""
    if src.onnx_bytes is not None:
        return accuracy.onnx_reference(src.onnx_bytes), "qdq" if _has_qdq(src.onnx_bytes) else "fp32"
    quantized = False
    try:
        from overdrive import quant

        quantized = any(True for _ in quant.quantizers(src.module))
    except ImportError:
        pass
    return accuracy.module_reference(src.module), "fake-quant" if quantized else "fp32"


def _all_float_warning(precision: str, kept: dict[str, str], device: torch.device) -> str:
    """The one line a build prints when every int8/fp8 layer lost to float at build time and stayed float."""
    worst = min(kept.values(), key=lambda why: float(why.split()[1].rstrip("x")))
    hint = ("this CPU has no int8 dot-product instructions (VNNI/AMX) for torch._int_mm; --backend onnxruntime has "
            "int8 kernels for it" if device.type == "cpu" and precision == "int8" else
            "the layers are too small to gain; build fp16/bf16")
    return (f"--precision {precision}: every {precision} layer ran slower than float when timed at build time "
            f"(slowest: {worst}), so all {len(kept)} stay float and the engine computes in float; {hint} "
            "(--layer-precision all keeps them {precision} anyway)").replace("{precision}", precision)


def _warn_uncalibrated(src: ModelSource, precision: str, calib: list[tuple[torch.Tensor, ...]] | None,
                       stacklevel: int = 3) -> None:
    """int8/fp8 from a float model without calibration data calibrates on the example (random) inputs, as
    ``trtexec --int8`` without ``--calib`` uses placeholder ranges: fine for timing, not for accuracy."""
    if calib:
        return
    if src.onnx_bytes is not None:
        if _has_qdq(src.onnx_bytes):
            return
    elif src.module is not None:
        try:
            from overdrive import quant
        except ImportError:
            return
        if any(True for _ in quant.quantizers(src.module)):  # quantized already (QAT): its ranges are kept
            return
    warnings.warn(f"--precision {precision} without calibration data (--calib): the ranges come from the example "
                  "inputs (random unless given), so the engine is fit for timing, not for accuracy; pass --calib "
                  "with real batches", UserWarning, stacklevel=stacklevel)


def best_candidates(device: torch.device, calibrated: bool) -> list[str]:
    """The precisions ``--best`` builds and times on ``device`` (like trtexec's --best, which enables every
    precision and keeps the fastest). int8/fp8 need calibration data (``calib``): without it they are not
    tried, because their scales would be meaningless.

    Example:
        >>> best_candidates(torch.device("cpu"), calibrated=True)
        ['fp32', 'int8']
    """
    if device.type == "cpu":
        return ["fp32"] + (["int8"] if calibrated else [])
    out = ["fp16", "bf16"]
    if calibrated:
        out += ["int8"] + (["fp8"] if torch.cuda.get_device_capability(device) >= (8, 9) else [])
    return out


def _resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise UsageError("--precision fp8 needs compute capability 8.9+ (Ada/Hopper); use fp16 or int8")
    if precision == "fp8" and device.type == "cpu":
        raise UsageError("--precision fp8 needs a CUDA GPU of compute capability 8.9+; use fp32 or int8 on CPU")
    return precision


class Builder:
    """Builds engines for one device and precision (like TensorRT's builder / trtexec).

    Example:
        >>> # engine = Builder(BuildConfig(precision="fp16", device="cuda")).build(model, (torch.randn(8, 3, 224, 224),))
        >>> # engine.save("resnet50.engine")
    """

    def __init__(self, config: BuildConfig | None = None, *, min_cosine: float | None = None, **overrides: Any) -> None:
        self.config = (config if config is not None else BuildConfig()).replace(**overrides)  # unknown key: UsageError
        # the output cosine to the float model an int8/fp8 engine must reach (engine/accuracy.py)
        self.min_cosine = accuracy.check_min_cosine(min_cosine)

    def build(self, model: Any, example_inputs: tuple[torch.Tensor, ...] | torch.Tensor | None = None,
              input_names: list[str] | None = None, calib: list[tuple[torch.Tensor, ...]] | None = None,
              onnx_path: str | None = None) -> Engine:
        """Build from an nn.Module, ONNX (path/bytes/ModelProto), a .pt2 path or ``pkg.module:factory``.

        ``precision="best"`` builds every candidate precision (:func:`best_candidates`), times each on the
        example inputs and returns the fastest; ``engine.header["best"]`` lists the candidates' median times.

        An int8/fp8 engine is compared with the float model on up to four ``calib`` batches (the example inputs
        without them); ``engine.info["accuracy"]`` holds the result, and a cosine below ``min_cosine`` warns.
        """
        if self.config.precision == "best":
            return self._build_best(model, example_inputs, input_names, calib, onnx_path)
        return self._build(model, example_inputs, input_names, calib, onnx_path, warn=True)

    def _build(self, model: Any, example_inputs: tuple[torch.Tensor, ...] | torch.Tensor | None,
               input_names: list[str] | None, calib: list[tuple[torch.Tensor, ...]] | None, onnx_path: str | None,
               warn: bool) -> Engine:
        cfg = self.config  # frozen: the build below works on replaced copies
        device = resolve_device(cfg.device)
        cfg = cfg.replace(device=str(device))
        src = to_source(model, input_names)
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        cfg = cfg.replace(profiles=_profiles(cfg.profiles, src, example_inputs))
        _check_onnx_dims(cfg.profiles, src)
        if not example_inputs and cfg.input_io_formats:  # --inputIOFormats int64:chw: the binding holds integers
            fmts = cfg.input_io_formats
            for i, n in enumerate(src.input_names):
                dt = getattr(torch, IO_DTYPES[(fmts[i] if len(fmts) > 1 else fmts[0]).split(":")[0]])
                if not dt.is_floating_point and (len(fmts) > 1 or n not in src.input_dtypes):
                    src.input_dtypes = {**src.input_dtypes, n: dt}
        example = tuple(x.to(device) for x in example_inputs) if example_inputs else _random_inputs(cfg.profiles, src, device)
        if len(example) != len(src.input_names):
            raise UsageError(f"model takes inputs {src.input_names} but {len(example)} example input(s) were given")
        precision = _resolve_precision(cfg.precision, device)
        cfg = cfg.replace(precision=precision)
        needs = [f for f, on in (("--inputIOFormats", cfg.input_io_formats), ("--outputIOFormats", cfg.output_io_formats),
                                 ("--gemm-gelu", cfg.gemm_gelu is True), ("--conv-fusion", cfg.conv_fusion is True),
                                 ("--sibling-gemms", cfg.sibling_gemms is True))
                 if on]
        forced = needs and cfg.backend == "auto"
        if forced:
            cfg = cfg.replace(backend="inductor")  # the onnxruntime backend takes the ONNX model's own I/O types and graph
        name, reason = choose_backend(cfg.backend, device, precision, src)
        if forced:
            reason = f"auto: {', '.join(needs)} need(s) the inductor backend"
        backend = backends.get(name)
        calibration, given, int8 = None, src, None
        if precision == "int8":  # static (calibrated) or dynamic (per-token) activation scales: engine/int8.py
            mode, why = int8_mode.resolve(cfg.int8_activations, backend, device, src, calib)
            cfg = cfg.replace(int8_activations=mode)
            int8 = {"activations": mode, "why": why}
        if precision in ("int8", "fp8") and cfg.int8_activations != "dynamic":  # dynamic scales need no calibration
            _warn_uncalibrated(src, precision, calib, stacklevel=4)
            if src.onnx_bytes is not None and not _has_qdq(src.onnx_bytes):  # float ONNX: calibrate it into Q/DQ
                from overdrive.engine.onnx import quantize_onnx

                batches, t_cal = calib or [tuple(x.cpu() for x in example)], time.perf_counter()
                src = replace(src, onnx_bytes=quantize_onnx(src.onnx_bytes, batches, precision))
                calibration = (f"ONNX Runtime quantize_static ({precision} Q/DQ) on {len(batches)} batch(es) in "
                               f"{time.perf_counter() - t_cal:.1f} s")
        example = _apply_io_formats(example, cfg, src, name)
        if cfg.gemm_gelu is True and name != "inductor":
            raise UsageError(f"--gemm-gelu rewrites the PyTorch graph for Inductor; the {name} backend cannot take it: "
                             "use --backend inductor, or drop --gemm-gelu")
        for flag, on in (("--conv-fusion", cfg.conv_fusion), ("--sibling-gemms", cfg.sibling_gemms)):
            if on is True and name != "inductor":
                raise UsageError(f"{flag} rewrites the PyTorch graph for Inductor; the {name} backend cannot take it: "
                                 f"use --backend inductor, or drop {flag}")
        if cfg.timing_cache and name != "inductor":
            warnings.warn(f"--timing-cache {cfg.timing_cache} has no effect with the {name} backend (it caches "
                          "Inductor's compiled kernels only); the file is neither read nor written", UserWarning, stacklevel=2)
        if name == "tensorrt":
            path = onnx_path or "model.onnx"
            atomic_write(path, src.as_onnx(tuple(x.cpu() for x in example), cfg.profiles, cfg.opset))
            backend.refuse(path, str(Path(path).with_suffix(".plan")), cfg, device)
        if int8 is not None and cfg.int8_activations == "dynamic" and int8_mode.smoothquant_applies(name, src, calib):
            t_sq = time.perf_counter()
            src, n = int8_mode.smoothed_source(src, calib)  # per-token scales after SmoothQuant (engine/int8.py)
            int8["smoothquant"] = (f"alpha 0.5 on {n} Linear layer(s), factors from {len(calib)} calibration "
                                   f"batch(es) in {time.perf_counter() - t_sq:.1f} s")
        t0 = time.perf_counter()
        sections, runner, meta = backend.build(src, example, cfg, device, calib)
        build_s = time.perf_counter() - t0
        outs = runner(*example)
        header = {
            "overdrive": __version__, "backend": name, "backend_reason": reason, "precision": precision,
            "device": device_facts(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "source": src.kind, "build_s": build_s, "backend_meta": meta, "config": cfg.to_dict(),
            "timing_cache": meta.get("timing_cache"), **({"calibration": calibration} if calibration else {}),
            **({"int8": {**int8, "ops": meta.get("int8_ops"),
                         **({"kept_float": meta["layers_kept_float"]} if meta.get("layers_kept_float") else {})}}
               if int8 else {}),
            **({"layers_kept_float": meta["layers_kept_float"]} if meta.get("layers_kept_float") else {}),
            "inputs": [{**p.to_dict(), "dtype": str(x.dtype).removeprefix("torch."),
                        "layout": "hwc" if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last) else "chw"}
                       for p, x in zip(_ordered(cfg.profiles, src.input_names), example)],
            "outputs": [{"name": n, "dtype": str(o.dtype).removeprefix("torch."), "opt_shape": list(o.shape)}
                        for n, o in zip(_output_names(src, len(outs)), outs)],
        }
        engine = Engine(header, sections, runner, device, build_s=build_s)
        kept = meta.get("layers_kept_float") or {}
        if warn and kept and not meta.get("int8_ops") and precision in ("int8", "fp8") and src.onnx_bytes is None:
            warnings.warn(_all_float_warning(precision, kept, device), UserWarning, stacklevel=3)
        if precision in ("int8", "fp8"):
            reference, vs = _reference(given)
            header["accuracy"] = record = accuracy.measure(engine, reference, vs, calib, example, self.min_cosine)
            if warn and record["passed"] is False:
                warnings.warn(accuracy.warning(record, precision), UserWarning, stacklevel=3)
        return engine

    def _build_best(self, model: Any, example_inputs: Any, input_names: list[str] | None,
                    calib: list[tuple[torch.Tensor, ...]] | None, onnx_path: str | None) -> Engine:
        device = resolve_device(self.config.device)
        # dynamic int8 needs no calibration data: asked for, it is a candidate without --calib
        dynamic = self.config.int8_activations == "dynamic" and device.type == "cpu"
        candidates = best_candidates(device, calibrated=bool(calib) or dynamic)
        t0 = time.perf_counter()
        times: dict[str, float | str] = {}
        best: tuple[float, Engine] | None = None
        rejected: dict[str, str] = {}
        for prec in candidates:
            try:
                acts = self.config.int8_activations if prec == "int8" else None
                eng = Builder(self.config, precision=prec, int8_activations=acts, min_cosine=self.min_cosine)._build(
                    model, example_inputs, input_names, calib, onnx_path, warn=False)
            except UsageError as exc:  # e.g. an ONNX model without Q/DQ nodes cannot be int8: skip, say why
                times[prec] = f"not built: {exc}"
                continue
            acc = eng.header.get("accuracy")
            if acc is not None and not acc["passed"]:  # a wrong engine must not win on speed
                rejected[prec] = ("accuracy not measured: " + acc["skipped"] if acc["passed"] is None
                                  else f"cosine {acc['cosine']:.4f} to the {acc['vs']} model < {acc['min_cosine']}")
                times[prec] = f"rejected: {rejected[prec]}"
                del eng
                continue
            given = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
            sec = _time_engine(eng, tuple(eng.check_inputs(tuple(given) if given else eng.random_inputs(), {})))
            times[prec] = sec * 1e3
            if best is None or sec < best[0]:
                best = (sec, eng)
            else:
                del eng
        if best is None:
            raise UsageError(f"--best: no candidate precision could be built ({times}); give one --precision")
        engine = best[1]
        skipped = [p for p in best_candidates(device, calibrated=True) if p not in candidates]
        engine.header["best"] = {"candidates_ms": times, "chosen": engine.header["precision"],
                                 "not_tried": {p: "no calibration data (--calib)" for p in skipped}, "rejected": rejected}
        engine.header["build_s"] = time.perf_counter() - t0
        return engine


def _output_names(src: ModelSource, n: int) -> list[str]:
    """The ONNX model's own output names (the bindings trtexec and polygraphy report), else output / outputN."""
    if len(src.onnx_output_names) == n:
        return list(src.onnx_output_names)
    return [f"output{i}" if n > 1 else "output" for i in range(n)]


def _time_engine(engine: Engine, inputs: tuple[torch.Tensor, ...]) -> float:
    """Median seconds per call on ``inputs`` (already on the engine's device): CUDA events on a GPU."""
    from overdrive._utils.timing import time_fn

    return statistics.median(time_fn(lambda: engine(*inputs), engine.device, warmup=3, repeat=10))


def _compile_counters() -> dict[str, int]:
    """Inductor's FX-graph cache counters (hits, misses, bypasses) so far in this process; {} without Inductor."""
    import sys

    if "torch._dynamo" not in sys.modules:  # an onnxruntime load: nothing compiles, and dynamo is not imported
        return {}
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {k: int(c[f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass")}


def _apply_io_formats(example: tuple[torch.Tensor, ...], cfg: BuildConfig, src: Any, backend: str) -> tuple[torch.Tensor, ...]:
    """The example inputs in the ``--inputIOFormats`` types and layouts: the engine's bindings take those."""
    fmts = cfg.input_io_formats
    if not fmts and not cfg.output_io_formats:
        return example
    if backend != "inductor":
        raise UsageError("--inputIOFormats/--outputIOFormats need the inductor backend (--backend inductor): the "
                         "onnxruntime backend takes the ONNX model's own input and output types")
    if not fmts:
        return example
    if len(fmts) not in (1, len(example)):
        raise UsageError(f"--inputIOFormats gives {len(fmts)} formats for {len(example)} inputs {src.input_names}; "
                         "give one per input, in order, or one for all")
    out = []
    for i, x in enumerate(example):
        dtype_name, layout = (fmts[i] if len(fmts) > 1 else fmts[0]).split(":")
        dt = getattr(torch, IO_DTYPES[dtype_name])
        if x.is_floating_point() != dt.is_floating_point:
            if len(fmts) == 1:  # one format for all: it applies to the float inputs (ids and masks keep their type)
                out.append(x)
                continue
            raise UsageError(f"--inputIOFormats {fmts[i]} for input {src.input_names[i]!r}, which is {x.dtype}: give a "
                             f"{'floating' if x.is_floating_point() else 'integer'} type for it")
        x = x.to(dt)
        if layout != "chw" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        out.append(x)
    return tuple(out)


def _ordered(profiles: list[ShapeProfile], names: list[str]) -> list[ShapeProfile]:
    by = {p.name: p for p in profiles}
    return [by[n] for n in names]


def _profiles(profiles: list[ShapeProfile], src: ModelSource, example: tuple[torch.Tensor, ...] | None) -> list[ShapeProfile]:
    names = src.input_names
    if profiles:
        if src.onnx_bytes is None and len(names) == 1 == len(profiles) and profiles[0].name != names[0]:
            src.input_names = names = [profiles[0].name]  # a module's one input takes the profile's name
        elif (src.module is not None and {p.name for p in profiles} != set(names)
              and takes_names(src.module, [p.name for p in profiles])):
            # a module that takes the profiles' names (input_ids, attention_mask, ...) is called by those names
            src.input_names = names = [p.name for p in profiles]
            src.input_dtypes = {**integer_dtypes(names), **{k: v for k, v in src.input_dtypes.items() if k in names}}
        given = {p.name for p in profiles}
        fixed = {n: s for n, s in (src.onnx_shapes or {}).items() if n in names and n not in given and s and all(s)}
        if fixed:  # as trtexec: inputs whose dims the ONNX model fixes need no shapes
            profiles = [*profiles, *(ShapeProfile.fixed(n, tuple(s)) for n, s in fixed.items())]
            given |= set(fixed)
        if given != set(names):
            missing, unknown = sorted(set(names) - given), sorted(given - set(names))
            raise UsageError(f"shape profiles must name every model input {names}: missing {missing}, unknown {unknown}")
        return _ordered(profiles, names)
    if example:
        return [ShapeProfile.fixed(n, tuple(x.shape)) for n, x in zip(names, example)]
    shapes = src.onnx_shapes
    if shapes and all(n in shapes and all(d for d in shapes[n]) for n in names):
        return [ShapeProfile.fixed(n, tuple(shapes[n])) for n in names]
    raise UsageError(f"give the input shapes: --shapes {names[0]}:1x3x224x224 (or --min/--opt/--max-shapes), or example inputs")


def _check_onnx_dims(profiles: list[ShapeProfile], src: ModelSource) -> None:
    """Refuse a profile that an ONNX model's fixed input dims cannot run (it built, then failed at run time)."""
    shapes = src.onnx_shapes or {}
    for p in profiles:
        fixed = shapes.get(p.name)
        if fixed is None:
            continue
        if len(fixed) != len(p.opt):
            raise UsageError(f"input {p.name!r} has rank {len(fixed)} in the ONNX model but the shape profile gives "
                             f"rank {len(p.opt)} ({'x'.join(map(str, p.opt))}); give {len(fixed)} dims")
        for d, (v, lo, hi) in enumerate(zip(fixed, p.min, p.max)):
            if v and (lo != v or hi != v):
                raise UsageError(f"input {p.name!r} dim {d} is fixed to {v} in the ONNX model, but the profile asks for "
                                 f"{lo}..{hi}; use {v} there, or re-export the model with that dim dynamic")


def _random_input(name: str, shape: tuple[int, ...], dt: torch.dtype, g: torch.Generator,
                  vocab: int | None = None) -> torch.Tensor:
    """One input for timing or a warm-up: floats from N(0, 1); integer inputs as their names say (masks all
    ones, token types zeros, positions 0..n-1, token ids in the vocabulary when known, else 0/1)."""
    if dt.is_floating_point:
        return torch.randn(shape, generator=g)
    if name.endswith("attention_mask") or name == "pixel_mask":
        return torch.ones(shape, dtype=torch.int64)  # every token attended to
    if name == "token_type_ids":
        return torch.zeros(shape, dtype=torch.int64)
    if name == "position_ids" and shape:
        return torch.arange(shape[-1]).expand(shape).contiguous()
    return torch.randint(0, vocab if isinstance(vocab, int) and vocab > 0 else 2, shape, generator=g)


def _random_inputs(profiles: list[ShapeProfile], src: ModelSource, device: torch.device, which: str = "opt",
                   seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    vocab = getattr(getattr(src.module, "config", None), "vocab_size", None)
    out = []
    for p in _ordered(profiles, src.input_names):
        dt = src.input_dtypes.get(p.name, torch.float32)
        shape = getattr(p, which)
        x = _random_input(p.name, tuple(shape), dt, g, vocab)
        out.append(x.to(dt).to(device))
    return tuple(out)


class Engine:
    """A built engine: call it, save it, load it, benchmark it.

    Example:
        >>> # engine = Engine.load("model.engine"); y = engine(torch.randn(1, 1, 8, 8)); engine.info["precision"]
    """

    def __init__(self, header: dict[str, Any], sections: dict[str, bytes], runner: Any, device: torch.device,
                 build_s: float | None = None, load_s: float | None = None,
                 load_compile: dict[str, int] | None = None, trust: dict[str, Any] | None = None) -> None:
        self.header, self.sections, self.runner, self.device = header, sections, runner, device
        # built here: trusted; loaded: what authenticate() found and whether its native sections were used
        self.trust = trust if trust is not None else {"signature": "built here", "trusted": True, "mode": "full"}
        self.build_s, self.load_s = build_s, load_s
        self.load_compile = load_compile  # Inductor graph-cache hits / misses / bypasses during the load
        self.profiles = [ShapeProfile.from_dict(i) for i in header["inputs"]]
        self.input_names = [p.name for p in self.profiles]
        self.input_dtypes = [_DT.get(i["dtype"], torch.float32) for i in header["inputs"]]
        self.input_layouts = [i.get("layout", "chw") for i in header["inputs"]]

    @property
    def info(self) -> dict[str, Any]:
        """Bindings, shapes, precision, backend and device, as stored in the file header."""
        h = self.header
        return {"backend": h["backend"], "backend_reason": h.get("backend_reason"), "precision": h["precision"],
                "device": h["device"], "torch": h["torch"], "cuda": h["cuda"], "source": h.get("source"),
                "inputs": h["inputs"], "outputs": h["outputs"], "build_s": h.get("build_s"), "load_s": self.load_s,
                "load_compile": self.load_compile,
                "runtime": getattr(self.runner, "via", h["backend"]), "size_bytes": sum(len(b) for b in self.sections.values()),
                "timing_cache": h.get("timing_cache"), "best": h.get("best"), "accuracy": h.get("accuracy"),
                "int8": h.get("int8"), "trust": self.trust}

    def save(self, path: str | Path) -> None:
        """Write the engine atomically, signed with the user's key (overdrive._utils.signing; the default key
        file is created on first use). An engine loaded without trust is saved unsigned: saving must not turn
        a file from elsewhere into one this user's key vouches for."""
        key = signing_key(create=True) if self.trust.get("trusted") else None
        if key is None:
            warnings.warn(f"saving an engine that was loaded untrusted ({self.trust.get('why')}) unsigned; rebuild it "
                          "with `overdrive build` to get a signed engine", stacklevel=2)
        fmt.EngineFile(self.header, self.sections).save(path, key)

    @classmethod
    def load(cls, path: str | Path, device: str | None = None, precision: str | None = None,
             trust: bool = False) -> Engine:
        """Load and check an engine; refuses another device kind/GPU, precision or torch build.

        An engine signed with this user's key loads whole. Any other (unsigned, signed elsewhere, or edited
        after signing) loads in safe mode: its program is compiled again from the ``torch.export`` section,
        read weights-only, and its AOTInductor library and compile cache are ignored (a slower first call,
        nothing from the file runs). ``trust=True`` (``--trust``) loads such an engine whole: only for engines
        from a source you trust. ``engine.info["trust"]`` says which happened.

        Example:
            >>> # Engine.load("model.engine").info["trust"]  # {'signature': 'signed', 'trusted': True, 'mode': 'full'}
        """
        ef = fmt.read(path)
        h = ef.header
        status, why = fmt.authenticate(h)
        trusted = status == "signed" or trust
        built = h["device"]
        if precision == "best" and not h.get("best"):
            raise UsageError(f"{path} was built for precision {h['precision']}, not with --best; load it without a "
                             "precision, or rebuild with --best")
        if precision is not None and precision != "best" and precision != h["precision"]:
            raise UsageError(f"{path} was built for precision {h['precision']}, not {precision}: an engine runs only at "
                             f"the precision it was built with; rebuild with --precision {precision}")
        if built["type"] == "cuda" and not torch.cuda.is_available() and device in (None, "auto"):
            raise UsageError(f"{path} was built for {describe_device(built)} and there is no CUDA GPU here; "
                             "rebuild it on this machine with --device cpu")
        dev = resolve_device(device or built["type"])
        here = device_facts(dev)
        if here["type"] != built["type"] or (built["type"] == "cuda" and here["compute_capability"] != built["compute_capability"]):
            raise UsageError(f"{path} was built for {describe_device(built)} but would run on {describe_device(here)}; engines are tied "
                             f"to the device they were built for: rebuild with `overdrive build --device {dev.type}` here")
        if h["backend"] == "inductor" and h["torch"].split("+")[0] != torch.__version__.split("+")[0]:
            raise UsageError(f"{path} was built with torch {h['torch']} but this is torch {torch.__version__}; Inductor "
                             "engines hold torch-version-specific programs: rebuild the engine with this torch")
        native_ok = True
        if built["type"] == "cpu" and (built.get("machine") != here.get("machine") or built.get("isa") != here.get("isa")):
            native_ok = False  # native code compiled for another CPU can crash here (illegal instruction)
            if h["backend"] == "inductor":
                warnings.warn(f"{path} was built for {describe_device(built)}, this is {describe_device(here)}: its "
                              "native code is not used; the program is compiled again for this CPU (a slower first "
                              "call). Rebuild the engine here to skip that", stacklevel=2)
        has_native = h["backend"] == "inductor" and bool({"aoti_package", "compile_cache"} & set(ef.sections))
        if not trusted and has_native:
            warnings.warn(f"{path}: {why}, so it loads in safe mode: compiled again from its exported program (weights "
                          "only), its AOTInductor library and compile cache unused (a slower first call). Rebuild it "
                          "with `overdrive build` here to get a signed engine, or load with --trust (trust=True) if "
                          "you trust where it came from", stacklevel=2)
        mode = "full" if (trusted and native_ok) or not has_native else ("recompiled" if trusted else "safe")
        t0 = time.perf_counter()
        before = _compile_counters()
        runner = backends.get(h["backend"]).load(ef.sections, h, dev, trusted=trusted, native_ok=native_ok)
        eng = cls(h, ef.sections, runner, dev,
                  trust={"signature": status, "why": why, "trusted": trusted, "mode": mode})
        # Load time includes the first call: for Inductor that is when the program compiles (from the cache).
        eng.runner(*_random_inputs(eng.profiles, ModelSource(input_names=eng.input_names,
                                                            input_dtypes=dict(zip(eng.input_names, eng.input_dtypes))), dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        eng.load_s = time.perf_counter() - t0
        after = _compile_counters()
        eng.load_compile = {k: after[k] - before.get(k, 0) for k in after} if after else None
        return eng

    def check_inputs(self, inputs: tuple[torch.Tensor, ...] = (), named: dict[str, torch.Tensor] | None = None,
                     move: bool = True) -> list[torch.Tensor]:
        """Order, validate against the profiles, cast and move the inputs."""
        if named:
            if inputs:
                raise UsageError("pass inputs either by position or by name, not both")
            missing = [n for n in self.input_names if n not in named]
            unknown = [n for n in named if n not in self.input_names]
            if missing or unknown:
                raise UsageError(f"engine inputs are {self.input_names}: missing {missing}, unknown {unknown}")
            inputs = tuple(named[n] for n in self.input_names)
        if len(inputs) != len(self.input_names):
            raise UsageError(f"engine takes {len(self.input_names)} input(s) {self.input_names}, got {len(inputs)}")
        out = []
        for x, p, dt, layout in zip(inputs, self.profiles, self.input_dtypes, self.input_layouts):
            x = torch.as_tensor(x)
            if layout == "hwc" and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)  # the binding's layout (no copy when it is already)
            if not p.contains(tuple(x.shape)):
                raise UsageError(f"input {p.name!r} has shape {tuple(x.shape)}, outside the engine's profile min {p.min} "
                                 f"max {p.max}; rebuild with --min-shapes/--max-shapes covering it")
            if x.is_floating_point() != dt.is_floating_point:
                raise UsageError(f"input {p.name!r} is {x.dtype} but the engine expects {dt}")
            out.append(x.to(self.device, dt) if move else x.to(dtype=dt))
        for group in self.header.get("backend_meta", {}).get("shared_dims", []):  # dims the program needs equal
            sizes = {f"{n}[{d}]": out[self.input_names.index(n)].shape[d] for n, d in group if n in self.input_names}
            if len(set(sizes.values())) > 1:
                raise UsageError(f"inputs {', '.join(f'{k}={v}' for k, v in sizes.items())} must be equal: the model "
                                 "uses one size for these dims (e.g. the sequence length of input_ids and attention_mask)")
        return out

    def run(self, *inputs: torch.Tensor, **named: torch.Tensor) -> list[torch.Tensor]:
        """All outputs as a list (copies: safe to keep across calls, also under CUDA graphs)."""
        xs = self.check_inputs(inputs, named)
        return [o.clone() for o in self.runner(*xs)]

    def __call__(self, *inputs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outs = self.run(*inputs, **named)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def random_inputs(self, shapes: dict[str, tuple[int, ...]] | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Inputs at the profiles' opt shapes (or ``shapes``), on the CPU, for exec and compare."""
        names = [p.name for p in self.profiles]
        unknown = sorted(set(shapes or {}) - set(names))
        if unknown:  # a misspelt --shapes name would otherwise run silently at the opt shapes
            raise UsageError(f"--shapes names input {', '.join(map(repr, unknown))}, which this engine does not have; "
                             f"its inputs are {', '.join(map(repr, names))}")
        g = torch.Generator().manual_seed(seed)
        out = []
        for p, dt, layout in zip(self.profiles, self.input_dtypes, self.input_layouts):
            shape = tuple((shapes or {}).get(p.name, p.opt))
            x = _random_input(p.name, shape, dt, g).to(dt)
            out.append(x.contiguous(memory_format=torch.channels_last) if layout == "hwc" and x.dim() == 4 else x)
        return tuple(out)

    def benchmark(self, **kwargs: Any) -> dict[str, Any]:
        """trtexec-style timing; see :func:`overdrive.engine.benchmark.benchmark` for the arguments."""
        from overdrive.engine.benchmark import benchmark

        return benchmark(self, **kwargs)
