"""Inductor backend: torch.export -> torch.compile (Inductor), CUDA graphs for static CUDA profiles.

The engine stores the serialized ExportedProgram (``torch.export.save``) and Inductor's compile cache
(``torch.compiler.save_cache_artifacts()``); loading deserializes the program and compiles it again
with the cache preloaded, so a load skips Triton autotuning and C++/PTX code generation. AOTInductor
packages are stored too when ``BuildConfig.aot`` asks for them, and loaded only where
``aoti_load_package`` works (torch >= 2.12: it segfaults on torch 2.11, even for a tiny model).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive.engine.backends.prepare import flatten_outputs, int8_gemms, lowp_layers, prepare, remainder_dtype
from overdrive.engine.backends import whole_engine
from overdrive.engine.backends.timing_cache import load_timing_cache, save_timing_cache
from overdrive.engine.config import BuildConfig
# registers overdrive::conv2d_relu (which engines use)
from overdrive.engine.conv_fusion import TimedChoice, TimedStemPad, fuse_conv_relu, pad_stem_channels
from overdrive.engine.fp32_flags import check_fp32_flags, fp32_flags, precision_flags
from overdrive.engine.lowp_conv_fusion import fuse_lowp_convs
from overdrive.engine.lowp_siblings import TimedLowpGroups
from overdrive.engine.passes import drop_constant_attention_masks, drop_inference_dropout, fuse_gemm_gelu
from overdrive.engine.sibling_gemms import TimedGroups, fuse_sibling_gemms
from overdrive.engine.export_dims import check_exported_dims, dynamic_shapes
from overdrive.engine.sources import ModelSource, load_exported, save_exported

NAME = "inductor"

# Held around every call of every inductor engine in the process. A call sets process-wide state (the fp32 flags,
# Inductor's freezing switch) and puts the caller's back after; two threads doing that at once ran one call under
# the other's restored flags and left the engine's flags in place of the caller's. CUDA-graph runners also write
# their inputs into, and return, buffers the next call overwrites. Reentrant: GraphRunner calls Runner under it.
_CALL_LOCK = threading.RLock()


def unavailable(device: torch.device) -> str | None:
    return None  # torch.compile ships with torch; CPU needs a C++ compiler, which Inductor checks itself


def aoti_works() -> bool:
    """AOTInductor loading segfaults on torch 2.11 (seen on the H200 machine); trust it from 2.12 on."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 12)


def int8_dynamic_unavailable(src: ModelSource, device: torch.device) -> str | None:
    """None when this backend builds int8 with dynamic activations for ``src`` on ``device``, else why not: it
    swaps the PyTorch model's Linear layers for per-token ``torch._int_mm`` ones (``quant.dynamic_int8``), on CPU."""
    if device.type == "cuda":
        return ("dynamic int8 is built for CPU engines (the onnxruntime backend, or inductor on CPU); on CUDA build "
                "static int8 (--calib)")
    if src.module is None:
        return ("dynamic int8 from an ONNX model is built by the onnxruntime backend (--backend onnxruntime); the "
                "inductor backend builds it from the PyTorch model")
    return None


def _mode(cfg: BuildConfig, device: torch.device) -> str:
    if cfg.compile_mode:
        return cfg.compile_mode
    # CUDA: CUDA graphs for static and dynamic profiles alike (one graph recorded per input shape met, in one
    # shared memory pool, as torch.compile(mode="reduce-overhead") does): a transformer at batch 8 is launch-bound,
    # and without graphs a dynamic BERT-base engine ran 3x slower than that baseline (benchmarks/transformer_engines.py)
    return "reduce-overhead" if device.type == "cuda" else "default"


class Runner:
    """Calls the compiled program under the engine's fp32 flags (``fp32``, from :func:`fp32_flags` or the header;
    torch.compile compiles at the first call, so they are in force then too), put back after each call; marks a new
    CUDA-graph step before each call so outputs stay valid.

    The flags are set at every call, CUDA-graph replays included: TorchDynamo guards on them (``allow_tf32`` is
    part of its global-state guard), so a call under the caller's flags would recompile rather than replay.

    Calls from several threads run one at a time (those flags are process-wide); :meth:`copied` also takes the
    copies of the outputs before another thread's call can overwrite them.

    Example:
        >>> r = Runner(lambda x: x + 1, fp32_flags("fp32"), "default", "torch.compile")
        >>> [y.tolist() for y in r.copied(torch.zeros(2))]
        [[1.0, 1.0]]
    """

    def __init__(self, fn: Callable, fp32: dict[str, str], mode: str, via: str) -> None:
        self.fn, self.fp32, self.mode, self.via = fn, fp32, mode, via

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        with _CALL_LOCK, precision_flags(self.fp32), torch.inference_mode():
            if self.mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            return flatten_outputs(self.fn(*xs))

    def copied(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        """One call's outputs as copies the caller owns (what :meth:`overdrive.engine.Engine.run` returns)."""
        with _CALL_LOCK:
            return [o.clone() for o in self(*xs)]


class GraphRunner(Runner):
    """The whole compiled program in one CUDA graph, for static CUDA profiles (TensorRT's ``--useCudaGraph``).

    The program is compiled without CUDA-graph trees (torch.compile's default mode); the first call compiles it,
    warms it up on a side stream and records one graph around all of it, on copies of that call's inputs. Every
    later call copies its inputs into those buffers and replays the graph: no Dynamo guards, no graph-tree
    bookkeeping, no per-call flag changes (the kernels were chosen under the engine's flags when recorded). The
    outputs are the graph's own buffers, overwritten by the next call (as under ``reduce-overhead``);
    :meth:`overdrive.engine.Engine.run` returns copies. A call must keep the recorded shapes and dtypes.

    A program that cannot be recorded (an op that syncs with the host or works on CPU tensors) warns once and runs
    without a graph from then on: correct, slower per call.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     r = GraphRunner(lambda x: x + 1, fp32_flags("fp32"), "torch.compile")
        ...     out = r(torch.zeros(2))  # no CUDA here: nothing to record, the program runs as it is
        >>> out[0].tolist(), r.via, len(w)
        ([1.0, 1.0], 'torch.compile, no CUDA graph', 1)
    """

    def __init__(self, fn: Callable, fp32: dict[str, str], via: str) -> None:
        super().__init__(fn, fp32, "default", via + ", one CUDA graph")
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ungraphed = False  # recording failed: plain calls
        self.static_in: list[torch.Tensor] = []
        self.static_out: list[torch.Tensor] = []

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        with _CALL_LOCK:  # the recorded input and output buffers are shared by every call
            return self._call(xs)

    def _call(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        if self.graph is None:
            if self.ungraphed:
                return Runner.__call__(self, *xs)
            try:
                return self._record(xs)
            except Exception as exc:  # noqa: BLE001 - any capture failure: run the program without a graph
                self.ungraphed, self.static_in, self.static_out = True, [], []
                self.via = self.via.replace(", one CUDA graph", ", no CUDA graph")
                warnings.warn(f"this engine's program could not be recorded as one CUDA graph ({type(exc).__name__}: "
                              f"{str(exc).strip()[:200]}); it runs without one (correct, slower per call). "
                              "torch.compile's own graphs skip such parts: rebuild with --compile-mode reduce-overhead",
                              RuntimeWarning, stacklevel=3)
                return Runner.__call__(self, *xs)
        if len(xs) != len(self.static_in):
            raise UsageError(f"this engine's CUDA graph takes {len(self.static_in)} input(s), got {len(xs)}")
        for s, x in zip(self.static_in, xs):
            if x.shape != s.shape or x.dtype != s.dtype:
                raise UsageError(f"input of shape {tuple(x.shape)} {x.dtype}: this engine's CUDA graph was recorded for "
                                 f"{tuple(s.shape)} {s.dtype} (a static profile); rebuild with --min-shapes/--max-shapes "
                                 "for other shapes")
            if x.data_ptr() != s.data_ptr():
                s.copy_(x)
        self.graph.replay()
        return self.static_out

    def _record(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        dev = next((x.device for x in xs if x.device.type == "cuda"), None)
        if dev is None:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            dev = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(dev):  # the graph records on the current device: the engine's, not cuda:0
            self.static_in = [x.to(dev).clone(memory_format=torch.preserve_format) for x in xs]
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles on the first call; the second runs what the graph will hold
                    Runner.__call__(self, *self.static_in)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = Runner.__call__(self, *self.static_in)
            self.graph, self.static_out = graph, out
            graph.replay()
        return out


def whole_graph(cfg: BuildConfig, device: torch.device, dynamic: bool) -> bool:
    """Whether this build runs as one CUDA graph (:class:`GraphRunner`): a CUDA device, a static profile, and no
    compile mode asked for (``--compile-mode`` keeps torch.compile's own graphs).

    Example:
        >>> whole_graph(BuildConfig(), torch.device("cuda"), False), whole_graph(BuildConfig(), torch.device("cuda"), True)
        (True, False)
    """
    return device.type == "cuda" and not dynamic and not cfg.compile_mode


def use_freezing(cfg: BuildConfig, device: torch.device) -> bool:
    """Inductor freezing for this build: ``cfg.freezing``, or on for CUDA when unset."""
    return cfg.freezing if cfg.freezing is not None else device.type == "cuda"


def use_gemm_gelu(cfg: BuildConfig, device: torch.device) -> bool:
    """GELU folded into the GEMM epilogue for this build: ``cfg.gemm_gelu``, or on for CUDA when unset.

    On the H200 it won for BERT-base bs256 bf16 (1.18x eager fp16 against 1.02x without it, 1.28x against
    1.13x with the mask dropped: ``engine_profile_quant_bert.md``, ``engine_profile_bert_ids.md``); on CPU it
    is not measured, so it stays opt-in there.

    Example:
        >>> use_gemm_gelu(BuildConfig(), torch.device("cuda")), use_gemm_gelu(BuildConfig(), torch.device("cpu"))
        (True, False)
    """
    return cfg.gemm_gelu if cfg.gemm_gelu is not None else device.type == "cuda"


def use_conv_fusion(cfg: BuildConfig, device: torch.device, dynamic: bool = False) -> bool:
    """Convolution (+BatchNorm) (+residual add) + ReLU rewritten to one cuDNN call for this build
    (:mod:`overdrive.engine.conv_fusion`): ``cfg.conv_fusion``, or, when unset, on for CUDA builds with static profiles
    (fp16/bf16 layers only: the pass leaves fp32 convolutions alone). On the H200 the fused call beat Inductor's
    convolution + Triton epilogue on every ResNet-50 shape (``conv_epilogue.md``), and a static ResNet-18 fp16 engine
    with it ran 1.28x torch.compile reduce-overhead; with a dynamic batch profile the same engine ran 0.49x with it
    and 0.92x without (``engine_demo_variants.md``), so dynamic profiles leave it off unless asked. On CPU it is the
    plain composition, so off there.

    Example:
        >>> cuda = torch.device("cuda")
        >>> use_conv_fusion(BuildConfig(), cuda), use_conv_fusion(BuildConfig(), cuda, dynamic=True)
        (True, False)
        >>> use_conv_fusion(BuildConfig(), torch.device("cpu"))
        False
    """
    return cfg.conv_fusion if cfg.conv_fusion is not None else (device.type == "cuda" and not dynamic)


def use_sibling_gemms(cfg: BuildConfig, device: torch.device, freezing: bool) -> bool:
    """Linears reading one input run as one GEMM for this build (:mod:`overdrive.engine.sibling_gemms`):
    ``cfg.sibling_gemms``, or on for CUDA when unset; only with freezing (the concatenated weight is then built once
    at compile time, not at every call). On CUDA each group is timed and fused only where one GEMM wins.

    Example:
        >>> cuda, cpu = torch.device("cuda"), torch.device("cpu")
        >>> use_sibling_gemms(BuildConfig(), cuda, True), use_sibling_gemms(BuildConfig(), cpu, False)
        (True, False)
    """
    return freezing and (cfg.sibling_gemms if cfg.sibling_gemms is not None else device.type == "cuda")


class _Frozen:
    """Calls a compiled function with Inductor's ``freezing`` set as at build time.

    Inductor compiles lazily at the first call, and reads ``freezing`` then; every call goes through
    here so that a recompile (new shape in a dynamic profile) sees the same setting. (Passing freezing as a
    torch.compile option instead, with no patch per call, left the engines 1.5-3x slower per call on the H200 in
    ``engine_zoo``: measured, not yet explained; so the patch stays.)"""

    def __init__(self, fn: Callable, freezing: bool) -> None:
        self.fn, self.freezing = fn, freezing

    def __call__(self, *xs: torch.Tensor) -> Any:
        # set and put back by hand: config.patch cost ~23 us of Python a call, this ~7 (CPU, measured)
        config = torch._inductor.config
        was = config.freezing
        if was == self.freezing:
            return self.fn(*xs)
        config.freezing = self.freezing
        try:
            return self.fn(*xs)
        finally:
            config.freezing = was


def _compile(module: nn.Module, cfg: BuildConfig, mode: str, dynamic: bool, freezing: bool = False) -> Callable:
    fn = torch.compile(module, mode=mode, dynamic=True if dynamic else False, fullgraph=True)
    return _Frozen(fn, freezing) if freezing else fn


def _export(module: nn.Module, example: tuple[torch.Tensor, ...], cfg: BuildConfig, src: ModelSource,
            dyn: Any, fp32: dict[str, str]) -> Any:
    with precision_flags(fp32), torch.no_grad():
        try:
            # _Cast.forward takes *xs, so the per-input specs nest one level down
            return torch.export.export(module, _export_example(example, cfg.profiles, src.input_names) if dyn else
                                       example, dynamic_shapes=(dyn,) if dyn else None, strict=False)
        except Exception as exc:
            fixed = _specialized_dim(str(exc), src.input_names)
            if fixed is not None:  # torch's message: a screen of mark_dynamic advice around L['xs'][0].size()[1]
                name, d, size = fixed
                p = {q.name: q for q in cfg.profiles}.get(name)
                rng = f" ({p.min[d]}..{p.max[d]})" if p is not None and d < len(p.min) else ""
                raise UsageError(f"input {name!r} dim {d}: the shape profile lets it vary{rng} but torch.export "
                                 f"fixed it at {size} for this model (an nn.LSTM/GRU, or Python code on that size); "
                                 f"make that dim {size} in the profile, or build with --backend onnxruntime") from exc
            hint = ("the model fixes a dim the shape profile lets vary: make that dim static in the profile, or change "
                    "the model" if "Constraints violated" in str(exc) else "fix the graph break it names")
            raise OverdriveError(f"torch.export failed for this model ({type(exc).__name__}: "
                                 f"{' '.join(str(exc).split())[:400]}); try --backend onnxruntime, or {hint}") from exc


def _specialized_dim(message: str, names: list[str]) -> tuple[str, int, int] | None:
    """(input name, dim, size) from torch.export's "Constraints violated" error for a dynamic dim the model fixed, or
    None when the message is another one. The module exported is the engine's ``forward(*xs)`` wrapper.

    Example:
        >>> _specialized_dim("Constraints violated (L['xs'][0].size()[1])! ... specialized it to be a constant (5).",
        ...                  ["x"])
        ('x', 1, 5)
    """
    import re

    m = re.search(r"Constraints violated \(L\['xs'\]\[(\d+)\]\.size\(\)\[(\d+)\]\)", message)
    c = re.search(r"specialized it to be a constant \((\d+)\)", message)
    if m is None or c is None or int(m.group(1)) >= len(names):
        return None
    return names[int(m.group(1))], int(m.group(2)), int(c.group(1))


def _fuse(ep: Any, example: tuple[torch.Tensor, ...], cfg: BuildConfig, device: torch.device, src: ModelSource,
          dynamic: bool) -> dict[str, Any]:
    """The graph passes on ``ep`` (in place), with the fusions they time on the GPU; returns what they did."""
    shared = check_exported_dims(ep, list(cfg.profiles), src.input_names) if dynamic else []
    drop_inference_dropout(ep)  # eval-mode dropout is the identity; left in, it hides patterns from the passes below
    dropped = (drop_constant_attention_masks(ep, _corner_inputs(example, cfg.profiles, src.input_names))
               if cfg.drop_constant_masks else [])
    gelus = fuse_gemm_gelu(ep) if use_gemm_gelu(cfg, device) else []
    cuda = device.type == "cuda"
    choice = TimedChoice(device) if cuda else None  # per shape: fused where it wins on this GPU
    conv_passes = use_conv_fusion(cfg, device, dynamic)
    # an image's 1 or 3 channels padded to cuDNN's 4-channel NHWC first-layer kernels, where timed faster
    stem_timer = TimedStemPad(device) if cuda else None
    stems = pad_stem_channels(ep, stem_timer) if conv_passes else []
    convs = fuse_conv_relu(ep, choice) if conv_passes else []
    # int8/fp8 convolutions (quant.to_real on CUDA): BatchNorm, residual, ReLU and the next quantize in their epilogue
    grouping = use_sibling_gemms(cfg, device, use_freezing(cfg, device))  # = cfg.groups_siblings(device.type)
    # the int8/fp8 Linear layers that read one quantized input as one GEMM too (asked for: --sibling-gemms), timed on
    # CUDA like the float ones
    lowp_groups = (TimedLowpGroups(device) if cuda else True) if cfg.groups_lowp_siblings(device.type) else None
    lowp = fuse_lowp_convs(ep, cfg.quantize_residuals, lowp_groups) if cfg.precision in ("int8", "fp8") else {}
    groups = TimedGroups(device) if cuda else None
    siblings = fuse_sibling_gemms(ep, groups) if grouping else []
    return {"shared_dims": shared, "attention_masks_dropped": len(dropped), "gemm_gelu_fused": len(gelus),
            "conv_relu_fused": len(convs), "stem_channels_padded": len(stems), "lowp_conv": lowp,
            "conv_relu_timed": sorted({v[1] for v in choice.verdicts.values()}) if choice else [],
            "stem_pad_timed": sorted({v[1] for v in stem_timer.verdicts.values()}) if stem_timer else [],
            "sibling_gemms_fused": len(siblings),
            "sibling_gemms_timed": sorted({v[1] for v in groups.verdicts.values()}) if groups else [],
            "lowp_sibling_gemms_timed": sorted({v[2] for v in lowp_groups.verdicts.values()})
            if isinstance(lowp_groups, TimedLowpGroups) else []}


def _runner(ep: Any, cfg: BuildConfig, device: torch.device, mode: str, dynamic: bool, freezing: bool,
            fp32: dict[str, str], graph: bool, example: tuple[torch.Tensor, ...]) -> tuple[Runner, float]:
    """The compiled program, compiled (and its CUDA graphs recorded) on ``example``; and the seconds that took."""
    compiled = _compile(ep.module(), cfg, mode, dynamic, freezing)
    runner = GraphRunner(compiled, fp32, "torch.compile") if graph else Runner(compiled, fp32, mode, "torch.compile")
    t0 = time.perf_counter()
    for _ in range(3 if mode == "reduce-overhead" else 1):  # CUDA graphs record on the 2nd/3rd call (1st: GraphRunner)
        runner(*example)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return runner, time.perf_counter() - t0


def _lowp_meta(module: nn.Module, cfg: BuildConfig, device: torch.device, src: ModelSource) -> dict[str, Any]:
    """What an int8/fp8 build records of its prepared module: the float remainder, its int8/fp8 kernels, the layers
    kept float and where each runs."""
    meta: dict[str, Any] = {}
    if cfg.precision in ("int8", "fp8"):  # what the layers without an int8/fp8 kernel run in
        rem = remainder_dtype(cfg.precision, device) if src.onnx_bytes is None else None
        meta["float_remainder"] = str(rem or torch.float32).removeprefix("torch.")
    if cfg.precision == "int8":  # {}: an imported Q/DQ graph, computed as fake-quant float arithmetic
        meta["int8_ops"] = int8_gemms(module)
    if cfg.precision in ("int8", "fp8"):
        meta["lowp_layers"] = lowp_layers(module)
    inner = getattr(module, "model", module)
    dropped_res = getattr(inner, "_overdrive_residuals_dropped", None)
    if dropped_res is not None:  # residual quantizers no int8/fp8 kernel would read, made plain adds
        meta["residual_quantizers_dropped"] = dropped_res
    kept = getattr(inner, "_overdrive_kept_float", None)
    if kept is not None:
        meta["layers_kept_float"] = kept
    replanned = getattr(inner, "_overdrive_replanned", 0)
    if replanned:  # convolutions timed again in the form their float neighbours left them (layer_choice)
        meta["layers_retimed_after_replan"] = replanned
    layers = getattr(inner, "_overdrive_layers", None)
    if layers:
        meta["layers"] = layers
    return meta


def build(src: ModelSource, example: tuple[torch.Tensor, ...], cfg: BuildConfig, device: torch.device,
          calib: list[tuple[torch.Tensor, ...]] | None = None) -> tuple[dict[str, bytes], Runner, dict[str, Any]]:
    if isinstance(src.module, torch.jit.ScriptModule):  # prepare() failed deep in a deepcopy of its parameters
        raise UsageError("the inductor backend compiles a Python module through torch.export, which cannot take a "
                         "TorchScript module (torch.jit.script / trace / load); build it with --backend onnxruntime, "
                         "or pass the original nn.Module")
    cache_info = load_timing_cache(cfg.timing_cache, cfg.trust_timing_cache) if cfg.timing_cache else None
    # the int8/fp8 layer timings the cache kept (reused, and extended by this build), not part of the header
    timings = cache_info.pop("layer_timings", {}) if cache_info is not None else None
    module = prepare(src, cfg, device, calib or [example], timings)
    float_build = whole_engine.all_float_build(module, src, cfg, device, example)
    if float_build is not None:  # every layer timed faster in float one by one: the model's own float build
        module = float_build
    dyn = dynamic_shapes(cfg.profiles, src.input_names)
    fp32 = fp32_flags(cfg.precision, cfg.allow_tf32)
    t0 = time.perf_counter()
    ep = _export(module, example, cfg, src, dyn, fp32)
    t_export = time.perf_counter() - t0
    t_passes = time.perf_counter()  # the graph passes, with the fusions they time on the GPU
    fused = _fuse(ep, example, cfg, device, src, dyn is not None)
    phases = {**getattr(module.model, "_overdrive_phases", {}), "export": t_export,
              "passes": time.perf_counter() - t_passes}
    if device.type == "cuda" and cfg.precision in ("int8", "fp8"):
        from overdrive.engine.lowp_conv_fusion import precompile_convs

        t0 = time.perf_counter()  # the program's int8/fp8 convolution kernels compiled side by side, not one by one
        try:
            fused["lowp_conv_precompiled"] = precompile_convs(ep, device)
        except Exception as exc:  # noqa: BLE001 - a warm-up: the compile below meets the kernels one by one instead
            fused["lowp_conv_precompiled"] = f"failed ({type(exc).__name__}: {str(exc)[:200]})"
        phases["lowp_precompile"] = time.perf_counter() - t0
    sections = {"exported_program": save_exported(ep)}
    mode = _mode(cfg, device)
    freezing = use_freezing(cfg, device)
    meta: dict[str, Any] = {"compile_mode": mode, "export_s": t_export, "dynamic": dyn is not None, "freezing": freezing,
                            **fused, "fp32_precision": fp32,  # applied again at load
                            "build_phases_s": {k: round(v, 2) for k, v in phases.items()}}
    meta.update(_lowp_meta(module, cfg, device, src))
    if float_build is not None:
        meta["float_build"] = ("every low-precision layer timed slower than float one by one, so the engine is the "
                               "model's float build, with its own weights")
    if aot_by_default(cfg, device):  # CPU: the AOTInductor package alone (loads about 2x faster than a recompile)
        t0 = time.perf_counter()
        sections["aoti_package"] = _aoti_package(ep, fp32, freezing)
        runner = _load_aoti(sections["aoti_package"], fp32)
        runner(*example)
        meta.update(compile_s=time.perf_counter() - t0, aot=True)
        meta["build_phases_s"]["compile"] = round(meta["compile_s"], 2)
        return sections, runner, meta
    if whole_graph(cfg, device, dyn is not None):
        mode = meta["compile_mode"] = "default"
        meta["cuda_graph"] = "whole"
    graph = bool(meta.get("cuda_graph"))
    runner, meta["compile_s"] = _runner(ep, cfg, device, mode, dyn is not None, freezing, fp32, graph, example)
    meta["build_phases_s"]["compile"] = round(meta["compile_s"], 2)
    if meta.get("lowp_layers") and src.onnx_bytes is None and whole_engine.whole_engine_timed(cfg, device):
        try:
            ep, runner = whole_engine.whole_engine_choice(module, ep, runner, example, cfg, device, src, mode, freezing, fp32,
                                              graph, meta, sections, dyn)
        except Exception as exc:  # noqa: BLE001 - the float twin failed to build or run: keep the engine as built
            meta["whole_engine"] = {"kept": cfg.precision, "why": f"not timed: its float twin failed "
                                                                  f"({type(exc).__name__}: {str(exc)[:200]})"}
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is not None:
        sections["compile_cache"] = artifacts[0]
    if cache_info is not None:
        cache_info["reused_layer_timings"] = getattr(module.model, "_overdrive_timings_reused", 0)
        save_timing_cache(cfg.timing_cache, artifacts[0] if artifacts is not None else None, cache_info, timings)
        meta["timing_cache"] = cache_info
    if cfg.aot:
        if not aoti_works():
            raise UsageError(f"AOTInductor packages crash on torch {torch.__version__} (aoti_load_package segfaults on "
                             "2.11); build without --aot: the engine then stores the program plus the compile cache")
        sections["aoti_package"] = _aoti_package(ep, fp32, freezing)
        meta["aot"] = True
    return sections, runner, meta


def _export_example(example: tuple[torch.Tensor, ...], profiles: list[Any], names: list[str]) -> tuple[torch.Tensor, ...]:
    """The example to trace a dynamic profile with: a dynamic dim whose opt size is 1 is traced at 2 instead,
    since torch.export specializes a size-1 dim to the constant 1 (min = opt = 1 profiles failed to export)."""
    by_name = {p.name: p for p in profiles}
    out = []
    for n, x in zip(names, example):
        p = by_name.get(n)
        shape = list(x.shape)
        if p is not None:
            shape = [2 if (d == 1 and lo != hi and hi >= 2) else d for d, lo, hi in zip(shape, p.min, p.max)]
        if shape == list(x.shape):
            out.append(x)
            continue
        y = torch.zeros(shape, dtype=x.dtype, device=x.device) if not x.is_floating_point() else \
            torch.randn(shape, device=x.device).to(x.dtype)
        out.append(y.contiguous(memory_format=torch.channels_last) if x.dim() == 4 and not x.is_contiguous()
                   and x.is_contiguous(memory_format=torch.channels_last) else y)
    return tuple(out)


def _corner_inputs(example: tuple[torch.Tensor, ...], profiles: list[Any], names: list[str]
                   ) -> list[tuple[torch.Tensor, ...]]:
    """The example, plus inputs at the profile's min and max shapes when a profile is dynamic."""
    by_name = {p.name: p for p in profiles}
    corners = [example]
    if any(not p.static for p in profiles):
        for end in ("min", "max"):
            corners.append(tuple(torch.zeros(getattr(by_name[n], end), dtype=x.dtype, device=x.device)
                                 if n in by_name else x for n, x in zip(names, example)))
    return corners


def aot_by_default(cfg: BuildConfig, device: torch.device) -> bool:
    """Whether this build stores only an AOTInductor package: ``cfg.aot`` unset, a CPU build, a torch whose
    AOTInductor loads (>= 2.12), and no option that needs the torch.compile path (--timing-cache, a compile
    mode). On CUDA the torch.compile path stays the default: it records CUDA graphs, AOTInductor does not."""
    return (cfg.aot is None and device.type == "cpu" and aoti_works() and not cfg.timing_cache
            and cfg.compile_mode is None)


def _aoti_package(ep: Any, fp32: dict[str, str], freezing: bool) -> bytes:
    with tempfile.TemporaryDirectory() as tmp, precision_flags(fp32):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(tmp, "model.pt2"),
                                                        inductor_configs={"freezing": freezing})
        return Path(path).read_bytes()  # closed at once (an open() left to the collector warned ResourceWarning)


def _load_aoti(package: bytes, fp32: dict[str, str]) -> Runner:
    tmp = tempfile.NamedTemporaryFile(suffix=".pt2", delete=False)
    try:
        tmp.write(package)
        tmp.close()
        loaded = torch._inductor.aoti_load_package(tmp.name)
    finally:
        os.unlink(tmp.name)
    return Runner(loaded, fp32, "default", "AOTInductor")


def load(sections: dict[str, bytes], header: dict[str, Any], device: torch.device, trusted: bool = False,
         native_ok: bool = True) -> Runner:
    """The engine's runner. ``trusted`` (signed with the user's key, or --trust) lets the AOTInductor library
    and the compile cache load; otherwise, or when the library was built for another CPU (``native_ok``
    False), the runner is compiled again from the exported program, read weights-only."""
    meta = header.get("backend_meta", {})
    precision = header["precision"]
    # the flags the engine was built under; engines from before the header recorded them: derived from the precision
    fp32 = check_fp32_flags(meta["fp32_precision"]) if "fp32_precision" in meta else fp32_flags(precision)
    if trusted and native_ok and "aoti_package" in sections and aoti_works():
        return _load_aoti(sections["aoti_package"], fp32)
    if trusted and native_ok and "compile_cache" in sections:
        torch.compiler.load_cache_artifacts(sections["compile_cache"])
    ep = load_exported(sections["exported_program"], "engine section 'exported_program'")
    mode = meta.get("compile_mode", "default")
    if not isinstance(mode, str) or mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise UsageError(f"engine header: backend_meta.compile_mode {mode!r} is not a torch.compile mode; rebuild the engine")
    fn = _compile(ep.module(), BuildConfig(precision=precision), mode, bool(meta.get("dynamic", False)),
                  bool(meta.get("freezing", False)))
    how = "torch.compile (from cache)" if trusted and native_ok and "compile_cache" in sections else "torch.compile"
    if meta.get("cuda_graph") == "whole" and device.type == "cuda":
        return GraphRunner(fn, fp32, how)  # records at the first call (Engine.load makes one)
    return Runner(fn, fp32, mode, how)
