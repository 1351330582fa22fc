"""Building an engine: ``Builder(cfg).build(model) -> Engine`` (the backend and precision chosen, int8
calibrated or dynamic, the accuracy of an int8/fp8 engine measured against the float model, ``--best``).
The built :class:`~overdrive.engine.runtime.Engine` saves, loads, runs and benchmarks (engine/runtime.py)."""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from overdrive import __version__
from overdrive._utils.device import resolve_device
from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.files import atomic_write
from overdrive._utils.inputs import forward_parameters
from overdrive.engine import accuracy, backends
from overdrive.engine import int8 as int8_mode
from overdrive.engine.config import IO_DTYPES, BuildConfig
from overdrive.engine.inputs import (apply_io_formats, build_inputs, check_example_in_profiles, check_onnx_dims,
                                     onnx_shared_dims, ordered, random_inputs, resolve_profiles, unpack_dataclasses)
from overdrive.engine.runtime import Engine, device_facts
from overdrive.engine.sources import (ModelSource, by_name, fit_input_names, float32_source, to_source,
                                     with_forward_dtypes)
from overdrive.engine.structured import dataclass_inputs, dataclass_outputs

__all__ = ["Builder", "best_candidates", "choose_backend", "compile_mode_warning"]


def choose_backend(requested: str, device: torch.device, precision: str, src: ModelSource,
                   dynamic: bool = False) -> tuple[str, str]:
    """``auto`` -> the fastest backend usable here for this device and precision, with the reason; ``dynamic``: the
    build's profile has a dynamic dim (a TorchScript module then goes to ONNX Runtime, the one backend taking it)."""
    if requested != "auto":
        why = backends.get(requested).unavailable(device)
        if why and requested != "tensorrt":
            raise UsageError(f"--backend {requested} is not usable on {device.type}: {why}")
        return requested, "asked for"
    ort_ok = backends.get("onnxruntime").unavailable(device) is None and precision in ("fp32", "tf32", "int8")
    if dynamic and ort_ok and isinstance(src.module, torch.jit.ScriptModule):
        return "onnxruntime", ("TorchScript with a dynamic profile: ONNX Runtime takes the module itself; "
                               "torch.export (inductor) cannot take TorchScript")
    if device.type == "cuda":
        return "inductor", "CUDA: Inductor kernels + CUDA graphs (ONNX Runtime here has no GPU provider)"
    if ort_ok:
        return "onnxruntime", "CPU fp32/int8: ONNX Runtime builds in seconds and runs small models faster than Inductor's C++"
    return "inductor", f"CPU {precision}: ONNX Runtime here runs fp32/int8 only"


def _has_qdq(onnx_bytes: bytes) -> bool:
    from overdrive.engine.backends.onnxruntime import has_qdq

    return has_qdq(onnx_bytes)


def _check_qdq_format(src: ModelSource, precision: str) -> None:
    """Refuse an int8 build of an fp8 Q/DQ model, or an fp8 build of an int8 one: the engine would compute in the
    model's own format under the other's name (its header, ``--best``'s table and the engine file's name)."""
    if precision not in ("int8", "fp8") or src.onnx_bytes is None or not _has_qdq(src.onnx_bytes):
        return
    from overdrive.engine.backends.onnxruntime import qdq_formats

    found = qdq_formats(src.onnx_bytes)
    other = "fp8" if precision == "int8" else "int8"
    if other in found and precision not in found:
        flag = f"--{other}"
        raise UsageError(f"the ONNX model's Q/DQ nodes quantize to {other}, not {precision}: build it with {flag} "
                         f"(precision={other!r}); a {precision} build would run {other} under the {precision} name")


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
    # called as the engine's export called it: by name where the inputs are not forward's first parameters
    return accuracy.module_reference(by_name(src.module, src.input_names)), "fake-quant" if quantized else "fp32"


def _float_accuracy(engine: Engine, src: ModelSource, backend: str, example: tuple[torch.Tensor, ...],
                    min_cosine: float) -> dict[str, Any] | None:
    """The accuracy record of a float (fp32/tf32/fp16/bf16) engine against the model it was built from, on the example
    inputs: a module as given (its floating inputs cast to its own float type), an ONNX model through ONNX Runtime
    (not for the onnxruntime backend, which is that runtime). None where there is nothing to check against or the
    reference cannot run (a check that cannot run says nothing, rather than failing a good build)."""
    if src.module is not None:
        dt = next((p.dtype for p in src.module.parameters() if p.is_floating_point()), torch.float32)
        base = accuracy.module_reference(by_name(src.module, src.input_names))

        def reference(batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
            return base(tuple(x.to(dt) if x.is_floating_point() else x for x in batch))

        vs = "fp32" if dt == torch.float32 else str(dt).removeprefix("torch.")
    elif src.onnx_bytes is not None and backend != "onnxruntime":
        reference, vs = accuracy.onnx_reference(src.onnx_bytes), "ONNX Runtime"
    else:
        return None
    try:
        return accuracy.measure(engine, reference, vs, None, example, min_cosine)
    except Exception:  # noqa: BLE001 - a check that cannot run says nothing, rather than failing a good build
        return None


def _float_accuracy_warning(record: dict[str, Any], precision: str) -> str:
    """The warning for a float engine whose outputs are off the model's: fp16 overflow (values past 65504 become inf)
    or a backend fault, not rounding.

    Example:
        >>> _float_accuracy_warning({"cosine": 0.0, "vs": "fp32", "on": "example inputs", "outputs": {}}, "fp16")[:48]
        'the fp16 engine is off the fp32 model: cosine 0.'
    """
    worst = min(((n, p["cosine"]) for n, p in record.get("outputs", {}).items() if "cosine" in p),
                key=lambda t: t[1], default=None)
    where = f" (worst output {worst[0]!r})" if worst and len(record["outputs"]) > 1 else ""
    fix = ("values past fp16's 65504 overflow to inf: build in bf16 (same speed on Ampere and newer) or fp32"
           if precision == "fp16" else "check the model runs in this precision, or build in fp32" if precision == "bf16"
           else "no rounding explains that: a fault in the build (the import or a graph rewrite); try the other backend "
                "(--backend onnxruntime or inductor) and report the model")
    return (f"the {precision} engine is off the {record['vs']} model: cosine {record['cosine']:.4f}{where} on "
            f"{record['on']}, below {record['min_cosine'] if 'min_cosine' in record else 0.99}; {fix}. "
            "engine.info['accuracy'] has each output's numbers")


def all_float(meta: dict[str, Any], precision: str) -> bool:
    """Whether an int8/fp8 build's layer timing kept every low-precision layer float (``backend_meta``): some layer
    was kept float and none is left on an int8/fp8 kernel. An fp8 engine has no ``int8_ops`` record, so one kept
    layer beside 43 fp8 convolutions read as all of them (EfficientNet-B0 warned "every fp8 layer ran slower").

    Example:
        >>> kept = {"layers_kept_float": {"fc": "fp8 0.8x float16 at 256x1280->1000"}}
        >>> all_float({**kept, "lowp_layers": 43}, "fp8"), all_float({**kept, "lowp_layers": 0}, "fp8")
        (False, True)
    """
    if precision not in ("int8", "fp8") or not meta.get("layers_kept_float"):
        return False
    return not meta.get("lowp_layers", 1 if meta.get("int8_ops") else 0)  # engines from before lowp_layers: int8_ops


def _all_float_warning(precision: str, kept: dict[str, str], device: torch.device,
                       whole: dict[str, Any] | None = None) -> str:
    """The one line a build prints when every int8/fp8 layer lost to float at build time and stayed float:
    layer by layer, or as a whole engine (``whole``: ``backend_meta["whole_engine"]``)."""
    if whole and whole.get("kept") != precision:
        return (f"--precision {precision}: the {precision} engine ran slower than the same engine in {whole['kept']} "
                f"when both were timed at build time ({whole['why']}), so its {len(kept)} {precision} layer(s) run in "
                f"{whole['kept']} (as TensorRT falls back to fp16 tactics when they win); build fp16 for the same "
                f"engine without calibration, or --layer-precision all to keep the {precision} layers anyway")
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

    def __init__(self, config: BuildConfig | None = None, *, min_cosine: float | None = None,
                 on_low_accuracy: str = "warn", **overrides: Any) -> None:
        self.config = (config if config is not None else BuildConfig()).replace(**overrides)  # unknown key: UsageError
        # the output cosine to the float model an int8/fp8 engine must reach (engine/accuracy.py)
        self.min_cosine = accuracy.check_min_cosine(min_cosine)
        # what a measured failure does: warn and return the engine, or raise (the CLI's default)
        self.on_low_accuracy = accuracy.check_on_low_accuracy(on_low_accuracy)

    def build(self, model: Any,
              example_inputs: tuple[torch.Tensor, ...] | torch.Tensor | dict[str, torch.Tensor] | None = None,
              input_names: list[str] | None = None,
              calib: list[tuple[torch.Tensor, ...] | dict[str, torch.Tensor]] | None = None,
              onnx_path: str | None = None) -> Engine:
        """Build from an nn.Module, ONNX (path/bytes/ModelProto), a .pt2 path or ``pkg.module:factory``.

        ``precision="best"`` builds every candidate precision (:func:`best_candidates`), times each on the
        example inputs and returns the fastest; ``engine.header["best"]`` lists the candidates' median times.

        An int8/fp8 engine is compared with the float model on up to four ``calib`` batches (the example inputs
        without them); ``engine.info["accuracy"]`` holds the result, and a cosine below ``min_cosine`` warns, or
        with ``on_low_accuracy="raise"`` raises :class:`OverdriveError` where the check is meaningful (measured on
        calibration data, or a dynamic-int8 engine, which needs none); a static engine built without calibration
        data is fit for timing only and still warns.

        ``example_inputs`` may be a dict by input name, as a Hugging Face model is called (``model(**batch)``): its
        keys name the engine's inputs, and ``calib`` batches may then be dicts too (keys the inputs lack are left
        out, as ``labels``).

        A model may take and return its own ``@dataclass`` instances: an argument ``Batch(x, mask)`` makes the engine
        take its tensors, named by field (``engine(x, mask)``, or ``engine(x=x, mask=mask)``; its other fields keep
        the example's values), and ``calib`` batches may be such instances too; a returned dataclass comes back, as a
        dict does, as an :class:`~overdrive.engine.runtime.EngineOutput` by field name (``out.logits``).
        """
        params = [n for n, p in (forward_parameters(model) or {}).items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] if isinstance(model, nn.Module) else []
        example_inputs, names, calib, packing = unpack_dataclasses(example_inputs, calib, params)
        if packing is not None:  # the engine takes the dataclasses' tensors, by field name
            if input_names is not None and len(input_names) != len(names):
                raise UsageError(f"input_names {list(input_names)} name {len(input_names)} inputs, but the example's "
                                 f"dataclasses hold {len(names)} tensors {names}; leave input_names out (the fields "
                                 "name them) or give one name per tensor")
            input_names = list(input_names or names)
        example_inputs, input_names, calib = build_inputs(example_inputs, input_names, calib)
        if self.config.precision == "best":
            return self._build_best(model, example_inputs, input_names, calib, onnx_path, packing)
        return self._build(model, example_inputs, input_names, calib, onnx_path, warn=True, packing=packing)

    def _build(self, model: Any, example_inputs: tuple[torch.Tensor, ...] | torch.Tensor | None,
               input_names: list[str] | None, calib: list[tuple[torch.Tensor, ...]] | None, onnx_path: str | None,
               warn: bool, packing: list[Any] | None = None) -> Engine:
        src = to_source(model, input_names)
        if packing is not None and (src.module is None or isinstance(src.module, torch.jit.ScriptModule)):
            raise UsageError(f"the example inputs hold dataclasses, which only a Python model takes; this {src.kind} "
                             "model takes tensors: give them as a tuple, or a dict by input name")
        # a model returning its own @dataclass is built (and its engine returns) as if it returned a dict of its
        # fields; one taking a dataclass is built from, and its engine takes, the dataclass's tensors
        with dataclass_outputs(src.module), dataclass_inputs(src.module, packing):
            return self._build_source(model, src, example_inputs, input_names, calib, onnx_path, warn)

    def _build_source(self, model: Any, src: ModelSource, example_inputs: tuple[torch.Tensor, ...] | None,
                      input_names: list[str] | None, calib: list[tuple[torch.Tensor, ...]] | None,
                      onnx_path: str | None, warn: bool) -> Engine:
        cfg = self.config  # frozen: the build below works on replaced copies
        device = resolve_device(cfg.device)
        cfg = cfg.replace(device=str(device))
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if input_names is None and isinstance(model, nn.Module) and example_inputs \
                and len(example_inputs) != len(src.input_names):
            src = fit_input_names(src, len(example_inputs))  # model(input_ids) without its optional attention_mask
        if not example_inputs and src.module is not None:  # inputs made from shapes: index / mask inputs not float
            src = with_forward_dtypes(src)
        cfg = cfg.replace(profiles=resolve_profiles(cfg.profiles, src, example_inputs))
        check_onnx_dims(cfg.profiles, src)
        if example_inputs:
            check_example_in_profiles(cfg.profiles, src.input_names, example_inputs)
        if not example_inputs and cfg.input_io_formats:  # --inputIOFormats int64:chw: the binding holds integers
            fmts = cfg.input_io_formats
            for i, n in enumerate(src.input_names):
                dt = getattr(torch, IO_DTYPES[(fmts[i] if len(fmts) > 1 else fmts[0]).split(":")[0]])
                if not dt.is_floating_point and (len(fmts) > 1 or n not in src.input_dtypes):
                    src.input_dtypes = {**src.input_dtypes, n: dt}
        # fp16/bf16 builds cast the model to that dtype themselves (no float32 copy of a large half model)
        src, was = float32_source(src) if cfg.precision not in ("fp16", "bf16") else (src, None)
        if was is not None and warn:
            warnings.warn(f"the model's weights are {str(was).removeprefix('torch.')}; the {cfg.precision} engine "
                          "computes from float32 copies of them (its float inputs and outputs are float32), so its "
                          f"outputs differ from the {str(was).removeprefix('torch.')} model's by float32 rounding",
                          UserWarning, stacklevel=4)
        if warn and src.kind == "module" and any(m.training for m in src.module.modules()):
            warnings.warn("the model is in training mode (Dropout active, BatchNorm on batch statistics); the engine "
                          "runs it in eval mode, as inference does, so it will not match the model as it is now: call "
                          "model.eval() before building", UserWarning, stacklevel=4)
        example = tuple(x.to(device) for x in example_inputs) if example_inputs else random_inputs(cfg.profiles, src, device)
        if was is not None:  # the float32 copy takes float32 inputs (an fp64 example would not run through it)
            example = tuple(x.float() if x.is_floating_point() else x for x in example)
        if len(example) != len(src.input_names):
            raise UsageError(f"model takes inputs {src.input_names} but {len(example)} example input(s) were given")
        precision = _resolve_precision(cfg.precision, device)
        cfg = cfg.replace(precision=precision)
        _check_qdq_format(src, precision)
        needs = [f for f, on in (("--inputIOFormats", cfg.input_io_formats), ("--outputIOFormats", cfg.output_io_formats),
                                 ("--gemm-gelu", cfg.gemm_gelu is True), ("--conv-fusion", cfg.conv_fusion is True),
                                 ("--sibling-gemms", cfg.sibling_gemms is True),
                                 ("--quantize-residuals", cfg.quantize_residuals))
                 if on]
        forced = needs and cfg.backend == "auto"
        if forced:
            cfg = cfg.replace(backend="inductor")  # the onnxruntime backend takes the ONNX model's own I/O types and graph
        name, reason = choose_backend(cfg.backend, device, precision, src,
                                      dynamic=any(not p.static for p in cfg.profiles))
        if forced:
            reason = f"auto: {', '.join(needs)} need(s) the inductor backend"
        backend = backends.get(name)
        calibration, given, int8 = None, src, None
        if precision == "int8":  # static (calibrated) or dynamic (per-token) activation scales: engine/int8.py
            mode, why = int8_mode.resolve(cfg.int8_activations, backend, device, src, calib)
            cfg = cfg.replace(int8_activations=mode)
            int8 = {"activations": mode, "why": why}
        if precision in ("int8", "fp8") and cfg.int8_activations != "dynamic":  # dynamic scales need no calibration
            _warn_uncalibrated(src, precision, calib, stacklevel=5)
            ort_int8 = name == "onnxruntime" and precision == "int8"  # that backend chooses its int8 layout itself
            if src.onnx_bytes is not None and not _has_qdq(src.onnx_bytes) and not ort_int8:
                # float ONNX: calibrate it into Q/DQ
                from overdrive.engine.onnx import quantize_onnx

                batches, t_cal = calib or [tuple(x.cpu() for x in example)], time.perf_counter()
                src = replace(src, onnx_bytes=quantize_onnx(src.onnx_bytes, batches, precision))
                calibration = (f"ONNX Runtime quantize_static ({precision} Q/DQ) on {len(batches)} batch(es) in "
                               f"{time.perf_counter() - t_cal:.1f} s")
        example = apply_io_formats(example, cfg, src, name)
        if cfg.gemm_gelu is True and name != "inductor":
            raise UsageError(f"--gemm-gelu rewrites the PyTorch graph for Inductor; the {name} backend cannot take it: "
                             "use --backend inductor, or drop --gemm-gelu")
        for flag, on in (("--conv-fusion", cfg.conv_fusion), ("--sibling-gemms", cfg.sibling_gemms),
                         ("--quantize-residuals", cfg.quantize_residuals)):
            if on is True and name != "inductor":
                raise UsageError(f"{flag} rewrites the PyTorch graph for Inductor; the {name} backend cannot take it: "
                                 f"use --backend inductor, or drop {flag}")
        if cfg.compile_mode not in (None, "default") and name != "inductor":
            warnings.warn(compile_mode_warning(cfg.compile_mode, name), UserWarning, stacklevel=4)
        if cfg.timing_cache and name != "inductor":
            warnings.warn(f"--timing-cache {cfg.timing_cache} has no effect with the {name} backend (it caches "
                          "Inductor's compiled kernels only); the file is neither read nor written", UserWarning, stacklevel=3)
        if name == "tensorrt":
            data = src.as_onnx(tuple(x.cpu() for x in example), cfg.profiles, cfg.opset)
            path = _unused_path(Path(onnx_path or "model.onnx"), data)
            if not path.exists():
                atomic_write(path, data)
            backend.refuse(str(path), str(Path(onnx_path or "model.onnx").with_suffix(".plan")), cfg, device)
        if int8 is not None and cfg.int8_activations == "dynamic" and int8_mode.smoothquant_applies(name, src, calib):
            t_sq = time.perf_counter()
            src, n = int8_mode.smoothed_source(src, calib)  # per-token scales after SmoothQuant (engine/int8.py)
            int8["smoothquant"] = (f"alpha 0.5 on {n} Linear layer(s), factors from {len(calib)} calibration "
                                   f"batch(es) in {time.perf_counter() - t_sq:.1f} s")
        t0 = time.perf_counter()
        keys: list[str] = []  # a model returning a dict (a Hugging Face ModelOutput): its keys name the outputs
        layout: list[list[Any]] = []  # and the engine's call returns them by key again (``output_mapping``)

        def _record(_m: Any, _a: Any, out: Any) -> None:
            keys[:], layout[:] = output_keys(out), output_mapping(out)

        # a TorchScript module takes no Python hooks (its outputs are then named output / outputN)
        scripted = isinstance(src.module, torch.jit.ScriptModule)
        hook = None if src.module is None or scripted else src.module.register_forward_hook(_record)
        try:
            sections, runner, meta = backend.build(src, example, cfg, device, calib)
        finally:
            if hook is not None:
                hook.remove()
        shared = meta.get("shared_dims") or []
        meta["shared_dims"] = shared + [g for g in onnx_shared_dims(src) if g not in shared]  # checked at each call
        build_s = time.perf_counter() - t0
        calibration = calibration or meta.pop("calibration", None)
        outs = runner(*example)
        header = {
            "overdrive": __version__, "backend": name, "backend_reason": reason, "precision": precision,
            "device": device_facts(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "source": src.kind, "build_s": build_s, "backend_meta": meta, "config": cfg.to_dict(),
            "timing_cache": meta.get("timing_cache"), **({"calibration": calibration} if calibration else {}),
            **({"int8": {**int8, "ops": meta.get("int8_ops"),
                         **({"layout": {"chosen": meta["int8_layout"], "why": meta.get("int8_layout_why")}}
                            if meta.get("int8_layout") else {}),
                         **({"float_convs": meta["float_convs"]} if meta.get("float_convs") else {}),
                         **({"kept_float": meta["layers_kept_float"]} if meta.get("layers_kept_float") else {})}}
               if int8 else {}),
            **({"layers_kept_float": meta["layers_kept_float"]} if meta.get("layers_kept_float") else {}),
            "inputs": [{**p.to_dict(), "dtype": str(x.dtype).removeprefix("torch."),
                        "layout": "hwc" if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last) else "chw"}
                       for p, x in zip(ordered(cfg.profiles, src.input_names), example)],
            "outputs": [{"name": n, "dtype": str(o.dtype).removeprefix("torch."), "opt_shape": list(o.shape)}
                        for n, o in zip(_output_names(src, len(outs), keys), outs)],
            # the model returned a mapping: calls return one too, by the same keys (runtime.EngineOutput)
            **({"output_mapping": layout} if layout and sum(n or 1 for _, n in layout) == len(outs) else {}),
        }
        engine = Engine(header, sections, runner, device, build_s=build_s)
        kept = meta.get("layers_kept_float") or {}
        if warn and all_float(meta, precision) and src.onnx_bytes is None:
            warnings.warn(_all_float_warning(precision, kept, device, meta.get("whole_engine")), UserWarning, stacklevel=4)
        if precision in ("int8", "fp8"):
            reference, vs = _reference(given)
            header["accuracy"] = record = accuracy.measure(engine, reference, vs, calib, example, self.min_cosine)
            dynamic = (int8 or {}).get("activations") == "dynamic"
            if warn and record["passed"] is False:
                if self.on_low_accuracy == "raise" and accuracy.meaningful(record, dynamic):
                    raise OverdriveError(accuracy.warning(record, precision) + accuracy.REFUSED)
                warnings.warn(accuracy.warning(record, precision), UserWarning, stacklevel=4)
        elif warn:
            # a float build is checked too, on the example inputs: fp16 overflow (inf) shows here, and a fault in an
            # import or a graph rewrite at any precision
            record = _float_accuracy(engine, given, name, example, self.min_cosine)
            if record is not None:
                header["accuracy"] = record
                if record["passed"] is False:
                    warnings.warn(_float_accuracy_warning(record, precision), UserWarning, stacklevel=4)
        return engine

    def _build_best(self, model: Any, example_inputs: Any, input_names: list[str] | None,
                    calib: list[tuple[torch.Tensor, ...]] | None, onnx_path: str | None,
                    packing: list[Any] | None = None) -> Engine:
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
                qres = self.config.quantize_residuals and prec in ("int8", "fp8")
                eng = Builder(self.config, precision=prec, int8_activations=acts, quantize_residuals=qres,
                              min_cosine=self.min_cosine,
                              on_low_accuracy=self.on_low_accuracy)._build(
                    model, example_inputs, input_names, calib, onnx_path, warn=False, packing=packing)
            except UsageError as exc:  # e.g. an ONNX model without Q/DQ nodes cannot be int8: skip, say why
                times[prec] = f"not built: {exc}"
                continue
            acc = eng.header.get("accuracy")
            if acc is not None and not acc["passed"]:  # a wrong engine must not win on speed
                rejected[prec] = ("accuracy not measured: " + acc["skipped"] if acc["passed"] is None
                                  else f"calibration data unfit to judge it: {acc['degenerate']}" if acc.get("degenerate")
                                  else f"{acc.get('by', 'cosine')} {acc['cosine']:.4f} to the {acc['vs']} model < "
                                       f"{acc['min_cosine']}")
                times[prec] = f"rejected: {rejected[prec]}"
                del eng
                continue
            meta = eng.header.get("backend_meta") or {}
            if all_float(meta, prec):  # its layers all run float: a float candidate is as fast, without the rounding
                whole = meta.get("whole_engine") or {}
                rejected[prec] = (f"every {prec} layer runs in float (" + (whole["why"] if whole.get("kept") not in
                                  (None, prec) else "each timed faster in float") + "): a float engine (the "
                                  f"model's own weights, or {prec}-rounded ones), no faster than the float candidate")
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


def compile_mode_warning(mode: str, backend: str) -> str:
    """The warning for a ``compile_mode`` (Inductor's) given to a build on another backend, which compiles nothing.

    Example:
        >>> compile_mode_warning("max-autotune", "onnxruntime")[:73]
        "BuildConfig(compile_mode='max-autotune') has no effect with the onnxrunti"
    """
    return (f"BuildConfig(compile_mode={mode!r}) has no effect with the {backend} backend: it is a mode of Inductor's "
            f"compile, and {backend} runs the ONNX graph with its own optimizations (at their highest level always); "
            "give backend='inductor' to use it, or drop compile_mode")


def _unused_path(path: Path, data: bytes) -> Path:
    """``path``, or where it holds other bytes (the user's own ONNX file, say), the first free ``<stem>.export<k>.onnx``
    beside it: the ONNX written for trtexec never replaces a file. A file holding ``data`` already is reused.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); (d / "m.onnx").write_bytes(b"mine")
        4
        >>> _unused_path(d / "m.onnx", b"export").name, _unused_path(d / "m.onnx", b"mine").name
        ('m.export1.onnx', 'm.onnx')
    """
    k = 0
    candidate = path
    while candidate.exists() and (not candidate.is_file() or candidate.read_bytes() != data):
        k += 1
        candidate = path.with_name(f"{path.stem}.export{k}{path.suffix or '.onnx'}")
    return candidate


def _output_names(src: ModelSource, n: int, keys: list[str] | None = None) -> list[str]:
    """The ONNX model's own output names (the bindings trtexec and polygraphy report), a PyTorch model's output keys
    (a dict or Hugging Face ModelOutput), else output / outputN."""
    if len(src.onnx_output_names) == n:
        return list(src.onnx_output_names)
    if keys and len(keys) == n and len(set(keys)) == n:
        return list(keys)
    return [f"output{i}" if n > 1 else "output" for i in range(n)]


def output_keys(out: Any) -> list[str]:
    """The names of a model output's tensors, in the engine's output order, where the output is a mapping (a dict, a
    Hugging Face ModelOutput): each key, or ``key.i`` for the tensors of a tuple / list under it; [] otherwise.

    Example:
        >>> output_keys({"logits": torch.zeros(1), "hidden": (torch.zeros(1), torch.zeros(1))})
        ['logits', 'hidden.0', 'hidden.1']
    """
    from overdrive.engine.backends.prepare import flatten_outputs

    if not isinstance(out, dict):
        return []
    names: list[str] = []
    for k, v in out.items():
        n = len(flatten_outputs(v))
        names += [str(k)] if isinstance(v, torch.Tensor) else [f"{k}.{i}" for i in range(n)]
    return names


def output_mapping(out: Any) -> list[list[Any]]:
    """How a mapping output (a dict, a Hugging Face ModelOutput) splits into the engine's flat outputs: ``[key, None]``
    for a tensor, ``[key, n]`` for the n tensors of a tuple / list under the key; [] for any other output (a key whose
    value holds no tensor, None for instance, is left out, as the engine's outputs leave it).

    Example:
        >>> output_mapping({"logits": torch.zeros(1), "hidden": (torch.zeros(1), torch.zeros(1)), "loss": None})
        [['logits', None], ['hidden', 2]]
    """
    from overdrive.engine.backends.prepare import flatten_outputs

    if not isinstance(out, dict):
        return []
    layout: list[list[Any]] = []
    for k, v in out.items():
        n = len(flatten_outputs(v))
        if isinstance(v, torch.Tensor):
            layout.append([str(k), None])
        elif n:
            layout.append([str(k), n])
    return layout


def _time_engine(engine: Engine, inputs: tuple[torch.Tensor, ...]) -> float:
    """Median seconds per call on ``inputs`` (already on the engine's device): CUDA events on a GPU."""
    from overdrive._utils.timing import time_fn

    return statistics.median(time_fn(lambda: engine(*inputs), engine.device, warmup=3, repeat=10))
