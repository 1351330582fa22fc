"""Inductor backend: torch.export -> torch.compile (Inductor), CUDA graphs for static CUDA profiles.

The engine stores the serialized ExportedProgram (``torch.export.save``) and Inductor's compile cache
(``torch.compiler.save_cache_artifacts()``); loading deserializes the program and compiles it again
with the cache preloaded, so a load skips Triton autotuning and C++/PTX code generation. AOTInductor
packages are stored too when ``BuildConfig.aot`` asks for them, and loaded only where
``aoti_load_package`` works (torch >= 2.12: it segfaults on torch 2.11, even for a tiny model).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.files import atomic_write
from overdrive._utils.signing import sign, signing_key, verify
from overdrive.engine.config import IO_DTYPES, BuildConfig
from overdrive.engine.conv_fusion import TimedChoice, fuse_conv_relu  # registers overdrive::conv2d_relu (engines use)
from overdrive.engine.passes import drop_constant_attention_masks, fuse_gemm_gelu
from overdrive.engine.sibling_gemms import TimedGroups, fuse_sibling_gemms
from overdrive.engine.sources import ModelSource, by_name, check_exported_dims, dynamic_shapes, load_exported

CACHE_MAGIC = b"ODTCACH1"  # + the HMAC of the payload under the user's signing key (64 hex digits) + the payload

NAME = "inductor"
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def unavailable(device: torch.device) -> str | None:
    return None  # torch.compile ships with torch; CPU needs a C++ compiler, which Inductor checks itself


def aoti_works() -> bool:
    """AOTInductor loading segfaults on torch 2.11 (seen on the H200 machine); trust it from 2.12 on."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 12)


class _Cast(nn.Module):
    """The engine's I/O around the compute precision: float inputs are cast to the model's dtype (they come
    in as fp32 by default, trtexec's default I/O, or as ``--inputIOFormats`` says) and go channels_last when
    4-D on CUDA; float outputs leave as ``out_dtype`` (fp32 unless ``--outputIOFormats`` says otherwise)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, channels_last: bool,
                 out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.model, self.dtype, self.channels_last, self.out_dtype = model, dtype, channels_last, out_dtype

    def forward(self, *xs: torch.Tensor) -> Any:
        ins = []
        for x in xs:
            if x.is_floating_point():
                x = x.to(self.dtype or torch.float32)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            ins.append(x)
        out = self.model(*ins)
        return _map(out, lambda t: t.to(self.out_dtype) if t.is_floating_point() else t)


def _map(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map(o, fn) for o in out)
    if isinstance(out, dict):
        return tuple(_map(v, fn) for v in out.values())  # ModelOutput / dict -> tuple in key order
    if hasattr(out, "to_tuple"):
        return tuple(_map(v, fn) for v in out.to_tuple())
    return out


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a model's output, in order: tensors, tuples/lists, and dicts (Hugging Face ModelOutput
    is one) in their key order; anything else (None, numbers) holds no tensor."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flatten_outputs(o)]
    return []


# The fp32 math an engine pins while it compiles and runs, keyed as torch.backends.<key>.fp32_precision names it
# (cuBLAS matmuls, cuDNN convolutions and RNNs, oneDNN's CPU matmuls, convolutions and RNNs), with torch's
# (backend, op) slot for each. A slot set to "none" reads through to its backend's "all" slot, that one to "generic".
_FP32_KEYS = {"cuda.matmul": ("cuda", "matmul"), "cudnn.conv": ("cuda", "conv"), "cudnn.rnn": ("cuda", "rnn"),
              "mkldnn.matmul": ("mkldnn", "matmul"), "mkldnn.conv": ("mkldnn", "conv"), "mkldnn.rnn": ("mkldnn", "rnn")}
_GENERIC, _ALL = ("generic", "all"), {"cuda": ("cuda", "all"), "mkldnn": ("mkldnn", "all")}
_SLOTS = (_GENERIC, *_ALL.values(), *_FP32_KEYS.values())  # parents first
_CONV_RNN = (("cuda", "conv"), ("cuda", "rnn"))
# what torch.backends.<...>.fp32_precision reads and writes, by (backend, op)
_get_fp32, _set_fp32 = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter


def fp32_flags(precision: str) -> dict[str, str]:
    """The fp32 math an engine of ``precision`` runs, recorded in its header (``backend_meta["fp32_precision"]``):
    TF32 on cuBLAS and cuDNN for 'tf32' and for the fp32 leftovers of fp16/bf16/int8/fp8, IEEE fp32 for 'fp32';
    IEEE on the CPU (oneDNN) for all, so a caller's ``set_float32_matmul_precision("medium")`` cannot turn an fp32
    CPU engine's matmuls into bf16 ones.

    Example:
        >>> fp32_flags("fp32")["cuda.matmul"], fp32_flags("fp16")["cudnn.conv"], fp32_flags("tf32")["mkldnn.matmul"]
        ('ieee', 'tf32', 'ieee')
    """
    gpu = "ieee" if precision == "fp32" else "tf32"
    return {k: gpu if b == "cuda" else "ieee" for k, (b, _) in _FP32_KEYS.items()}


_FP32_CHOICES = (fp32_flags("fp32"), fp32_flags("tf32"))


def _check_fp32_flags(flags: Any) -> dict[str, str]:
    if flags not in _FP32_CHOICES:
        raise UsageError(f"the engine header's backend_meta.fp32_precision is {flags!r}; this overdrive runs "
                         f"{_FP32_CHOICES[0]} or {_FP32_CHOICES[1]}: rebuild the engine")
    return flags


def _as_set(slot: tuple[str, str], parent: tuple[str, str], read: dict[tuple[str, str], str],
            parent_as_set: str) -> str:
    """What ``slot`` was set to, "none" (inherit) included: the getter answers a "none" slot with its parent's value,
    so one that reads like its parent (and not "none") is told apart by setting the parent to another value for a
    moment. (torch 2.13's untouched cuDNN conv/rnn default reads "tf32" under an unset parent: taken as "tf32".)"""
    value = read[slot]
    if value == "none" or value != read[parent]:
        return value
    probe = "ieee" if value != "ieee" else "tf32"
    _set_fp32(*parent, probe)
    follows = _get_fp32(*slot) == probe
    _set_fp32(*parent, parent_as_set)
    return "none" if follows else value


@contextlib.contextmanager
def precision_flags(flags: dict[str, str]) -> Iterator[None]:
    """Run the block with the engine's fp32 math ``flags`` (one of :func:`fp32_flags`), then put the caller's flags
    back as they were, also on an exception. About 20 plain attribute reads and writes per use.

    Each backend's "all" slot (Inductor reads those too) and both matmul slots are set to the engine's value, and
    the other per-op slots where they do not inherit it already; each is put back after ("none" again where it
    inherited). The legacy views, ``torch.get_float32_matmul_precision()`` and ``torch.backends.cudnn.allow_tf32``,
    are moved in step where they disagree, since torch raises ("a mix of the legacy and new APIs") otherwise: at
    every CUDA matmul, in Inductor and in torch.export. The cuDNN one's setter writes conv/rnn, which torch 2.13
    starts in an internal "untouched default" that no setter can put back (torch.export's own flag restore
    overwrites it too): where it must move (an fp32 engine under torch's defaults) they come back reading as before.

    Example:
        >>> with precision_flags(fp32_flags("tf32")):
        ...     torch.backends.cuda.matmul.fp32_precision
        'tf32'
    """
    flags = _check_fp32_flags(flags)
    undo: list[tuple[tuple[str, str], str]] = []  # (slot, value as the caller set it), put back last to first
    matmul = cudnn = None  # the caller's legacy values, where they had to move
    try:
        read = {s: _get_fp32(*s) for s in _SLOTS}
        legacy: list[Any] = []
        for get in (torch.get_float32_matmul_precision, lambda: torch.backends.cudnn.allow_tf32):
            try:
                legacy.append(get())
            except RuntimeError:  # the caller's slots disagree with it: read again once they agree
                legacy.append(None)
        was = {_GENERIC: read[_GENERIC]}  # the root reads as set
        for slot in _SLOTS[1:]:
            parent = _GENERIC if slot[1] == "all" else _ALL[slot[0]]
            was[slot] = _as_set(slot, parent, read, was[parent])
        for backend, parent in _ALL.items():
            want = flags["cuda.matmul" if backend == "cuda" else "mkldnn.matmul"]  # one value per backend
            if read[parent] != want:
                undo.append((parent, was[parent]))
                _set_fp32(*parent, want)
        for key, slot in _FP32_KEYS.items():
            # matmul slots always: torch.export sets the "all" slots to "none" while it traces, and the legacy
            # matmul precision must agree with both; the others where they neither inherit nor hold the value
            if slot[1] == "matmul" or (was[slot] != "none" and was[slot] != flags[key]):
                undo.append((slot, was[slot]))
                _set_fp32(*slot, flags[key])
        tf32 = flags["cuda.matmul"] == "tf32"
        if legacy[0] is None:  # with the slots above, the one disagreement left: a TF32 slot against 'highest'
            _set_fp32("cuda", "matmul", "ieee")
            legacy[0] = torch.get_float32_matmul_precision()
            _set_fp32("cuda", "matmul", flags["cuda.matmul"])
        if (legacy[0] != "highest") != tf32:
            matmul = legacy[0]
            torch.backends.cuda.matmul.allow_tf32 = tf32  # 'high' or 'highest', and the cuda.matmul slot as flags say
        tf32 = flags["cudnn.conv"] == "tf32"
        if legacy[1] is None:
            try:  # conv and rnn agree now: it raises only where it differs from them
                legacy[1] = torch.backends.cudnn.allow_tf32
            except RuntimeError:
                legacy[1] = not tf32
        if legacy[1] != tf32:
            cudnn = legacy[1]
            undo += [(s, was[s]) for s in _CONV_RNN]
            torch.backends.cudnn.allow_tf32 = tf32  # writes conv and rnn: TF32, or "none" (they follow cuda's slot)
        yield
    finally:
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)  # this writes both matmul slots: they are put back below
        if cudnn is not None:
            torch.backends.cudnn.allow_tf32 = cudnn  # this writes conv and rnn: put back below
        for slot, value in reversed(undo):
            _set_fp32(*slot, value)


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


def _dynamic_int8(model: nn.Module) -> nn.Module:
    try:
        from overdrive import quant
    except ImportError as exc:
        raise OverdriveError("--int8-activations dynamic on the inductor backend needs overdrive.quant, which is not "
                             "installed in this overdrive; use --backend onnxruntime") from exc
    return quant.dynamic_int8(model)


def int8_gemms(module: nn.Module) -> dict[str, int]:
    """The int8 GEMM layers of a prepared module, by kernel: ``{"torch._int_mm": 13}`` ({} when none)."""
    from overdrive.quant.real import Int8Conv1x1, Int8Linear

    n = sum(isinstance(m, (Int8Linear, Int8Conv1x1)) and m.fmt == "int8" for m in module.modules())
    return {"torch._int_mm": n} if n else {}


def _quantize(model: nn.Module, precision: str, calib: list[tuple[torch.Tensor, ...]]) -> nn.Module:
    try:
        from overdrive import quant
    except ImportError as exc:
        raise OverdriveError(f"--precision {precision} from a float model needs overdrive.quant, which is not installed "
                             "in this overdrive; build from a Q/DQ ONNX model instead, or use fp16/bf16") from exc

    dev = next((p.device for p in model.parameters()), torch.device("cpu"))

    def forward_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for batch in calib:
                m(*(x.to(dev) for x in batch))

    fmts = {q.config.format for _, q in quant.quantizers(model) if q.enabled}
    if fmts and fmts != {"int8" if precision == "int8" else "fp8_e4m3"}:
        raise UsageError(f"the model is quantized already to {sorted(fmts)}, not {precision}; build it with the precision "
                         "it was quantized to, or pass the float model")
    if not any(True for _ in quant.quantizers(model)):  # a model quantized already (QAT, sparse-quantized) keeps its amax
        cfg = quant.INT8_DEFAULT if precision == "int8" else quant.FP8_DEFAULT
        model = quant.quantize(model, cfg, forward_loop)
    return quant.to_real(model)


def remainder_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """What the layers without an int8/fp8 kernel run in: fp16 on CUDA (trtexec's ``--int8 --fp16``, which
    every TensorRT int8 deployment uses: 3x3 convs, attention, norms and activations in fp32 would cost
    more than the low-precision GEMMs save), the model's own fp32 on CPU (no fast fp16 there)."""
    return torch.float16 if precision in ("int8", "fp8") and device.type == "cuda" else None


def cast_float_remainder(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every float parameter and buffer to ``dtype`` except those of the real int8/fp8 GEMM modules
    (their int8/fp8 weights and fp32 scales stay as calibrated). In place; returns ``model``.

    Example:
        >>> # cast_float_remainder(quant.to_real(calibrated), torch.float16)
    """
    from overdrive.quant.real import _LowPrecisionGemm

    keep = {id(t) for m in model.modules() if isinstance(m, _LowPrecisionGemm)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    for m in model.modules():
        if isinstance(m, _LowPrecisionGemm):
            continue
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in keep and p.is_floating_point() and p.dtype != dtype and p.element_size() > 1:
                p.data = p.data.to(dtype)
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and id(b) not in keep and b.is_floating_point() and b.element_size() > 1:
                m._buffers[name] = b.to(dtype)
    return model


def prepare(src: ModelSource, cfg: BuildConfig, device: torch.device,
            calib: list[tuple[torch.Tensor, ...]]) -> nn.Module:
    """The module to export: a copy of the model in the build precision on ``device``."""
    model = copy.deepcopy(src.module) if src.module is not None else src.as_module()
    if src.module is not None:  # called by its input names (GPT-2's second parameter is its cache, not the mask)
        model = by_name(model, src.input_names)
    model = model.eval().to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    dtype = _HALF.get(cfg.precision)
    if cfg.precision in ("int8", "fp8"):
        if src.onnx_bytes is None and cfg.int8_activations == "dynamic":  # per-token scales, no calibration
            model = _dynamic_int8(model)
        elif src.onnx_bytes is None:  # a Q/DQ ONNX model is quantized already (its Q/DQ graph runs as imported)
            model = _quantize(model, cfg.precision, calib)
            dtype = remainder_dtype(cfg.precision, device)
            if dtype is not None:
                model = cast_float_remainder(model, dtype)
        if src.onnx_bytes is None and cfg.layer_precision == "timed":  # a layer whose int8/fp8 GEMM loses stays float
            from overdrive.engine.layer_choice import keep_float_where_faster

            x = tuple(t.to(device) for t in calib[0])
            x = tuple(t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in x)
            model, kept = keep_float_where_faster(model, x, device, dtype)
            model._overdrive_kept_float = kept
    elif dtype is not None:
        model = model.to(dtype)
    cl = cfg.channels_last and device.type == "cuda"
    if cl:
        model = model.to(memory_format=torch.channels_last)
    out_dtype = getattr(torch, IO_DTYPES[cfg.output_io_formats[0].split(":")[0]]) if cfg.output_io_formats else torch.float32
    if not out_dtype.is_floating_point:
        raise UsageError(f"--outputIOFormats {cfg.output_io_formats[0]}: the engine's outputs are floating point here; "
                         "give fp32, fp16 or bf16")
    return _Cast(model, dtype, cl, out_dtype).eval()


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
    part of its global-state guard), so a call under the caller's flags would recompile rather than replay."""

    def __init__(self, fn: Callable, fp32: dict[str, str], mode: str, via: str) -> None:
        self.fn, self.fp32, self.mode, self.via = fn, fp32, mode, via

    def __call__(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        with precision_flags(self.fp32), torch.inference_mode():
            if self.mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            return flatten_outputs(self.fn(*xs))


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


def use_conv_fusion(cfg: BuildConfig, device: torch.device) -> bool:
    """Convolution (+BatchNorm) (+residual add) + ReLU rewritten to one cuDNN call for this build
    (:mod:`overdrive.engine.conv_fusion`): ``cfg.conv_fusion``, or on for CUDA when unset (fp16/bf16 layers only:
    the pass leaves fp32 convolutions alone). On the H200 the fused call beat Inductor's convolution + Triton
    epilogue on every ResNet-50 shape (``conv_epilogue.md``); on CPU it is the plain composition, so off there.

    Example:
        >>> use_conv_fusion(BuildConfig(), torch.device("cuda")), use_conv_fusion(BuildConfig(), torch.device("cpu"))
        (True, False)
    """
    return cfg.conv_fusion if cfg.conv_fusion is not None else device.type == "cuda"


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
        with torch._inductor.config.patch(freezing=self.freezing):
            return self.fn(*xs)


def _compile(module: nn.Module, cfg: BuildConfig, mode: str, dynamic: bool, freezing: bool = False) -> Callable:
    fn = torch.compile(module, mode=mode, dynamic=True if dynamic else False, fullgraph=True)
    return _Frozen(fn, freezing) if freezing else fn


def load_timing_cache(path: str, trust: bool = False) -> dict[str, Any]:
    """Preload Inductor's compile cache from ``path`` (``--timing-cache``) if the file exists.

    The cache is handed to ``torch.compiler.load_cache_artifacts``, which unpickles, so it is loaded only
    when it carries this user's signature (written by :func:`save_timing_cache`) or ``trust`` is set; an
    unsigned or foreign file raises UsageError (before the build, the file left as it is). Returns what was done, for ``engine.info["timing_cache"]``. A signed file whose payload is not a
    cache written by ``torch.compiler.save_cache_artifacts`` raises UsageError naming it.

    Example:
        >>> # load_timing_cache("model.cache")  # {'path': 'model.cache', 'loaded': True, 'loaded_bytes': 51234, ...}
    """
    info: dict[str, Any] = {"path": str(path), "loaded": False, "loaded_bytes": 0, "loaded_artifacts": 0}
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--timing-cache {path}: folder {folder} does not exist; create it or give another path")
    if not os.path.exists(path):
        return info
    try:
        raw = open(path, "rb").read()
    except OSError as exc:
        raise UsageError(f"--timing-cache {path}: cannot read it ({exc}); give a readable file or a new path") from exc
    data, why = _verified_cache(raw)
    if why is not None and not trust:  # refused before the build, and the file is left as it is
        raise UsageError(f"--timing-cache {path}: {why}, and a cache unpickles when loaded, so only caches signed "
                         "with your key load; delete the file (the next build writes a signed one), give another "
                         "path, or pass --trust-timing-cache if you know where it came from")
    if why is not None:  # trusted: the whole file, or the payload after a foreign signature
        data = raw[len(CACHE_MAGIC) + 64:] if raw.startswith(CACHE_MAGIC) else raw
    cache_info = torch.compiler.load_cache_artifacts(data) if data else None
    if cache_info is None:  # torch returns None (and logs) when the bytes do not deserialize
        raise UsageError(f"--timing-cache {path}: the file is empty or not an Inductor compile cache "
                         f"(torch.compiler.save_cache_artifacts bytes from torch {torch.__version__}); delete it "
                         "or give a new path, and the next build writes a fresh one")
    info.update(loaded=True, loaded_bytes=len(raw),
                loaded_artifacts=sum(len(v) for v in getattr(cache_info, "artifacts", {}).values()))
    return info


def _verified_cache(raw: bytes) -> tuple[bytes, str | None]:
    """(payload, None) when ``raw`` is a cache signed with this user's key, else (b"", why not)."""
    if not raw.startswith(CACHE_MAGIC):
        return b"", "it is not signed (written by an older overdrive or another tool)"
    mac, payload = raw[len(CACHE_MAGIC):len(CACHE_MAGIC) + 64].decode("ascii", "replace"), raw[len(CACHE_MAGIC) + 64:]
    key = signing_key(create=False)
    if key is None:
        return b"", "it is signed but there is no signing key here to check it with"
    if not verify(payload, mac, key.key):
        return b"", "its signature does not verify under your key (signed elsewhere, or changed)"
    return payload, None


def save_timing_cache(path: str, artifacts: bytes | None, info: dict[str, Any]) -> None:
    """Write the compile cache to ``path``, signed with the user's key, atomically (temp file + rename);
    keeps the old file if there is nothing new."""
    if not artifacts:
        info["saved_bytes"] = 0
        return
    key = signing_key(create=True)
    try:
        blob = CACHE_MAGIC + sign(artifacts, key.key).encode("ascii") + artifacts
        atomic_write(path, blob)
    except OSError as exc:
        raise UsageError(f"--timing-cache {path}: cannot write it ({exc}); give a path in a writable folder") from exc
    info["saved_bytes"] = len(blob)


def build(src: ModelSource, example: tuple[torch.Tensor, ...], cfg: BuildConfig, device: torch.device,
          calib: list[tuple[torch.Tensor, ...]] | None = None) -> tuple[dict[str, bytes], Runner, dict[str, Any]]:
    cache_info = load_timing_cache(cfg.timing_cache, cfg.trust_timing_cache) if cfg.timing_cache else None
    module = prepare(src, cfg, device, calib or [example])
    dyn = dynamic_shapes(cfg.profiles, src.input_names)
    fp32 = fp32_flags(cfg.precision)
    t0 = time.perf_counter()
    with precision_flags(fp32), torch.no_grad():
        try:
            # _Cast.forward takes *xs, so the per-input specs nest one level down
            ep = torch.export.export(module, _export_example(example, cfg.profiles, src.input_names) if dyn else example,
                                     dynamic_shapes=(dyn,) if dyn else None, strict=False)
        except Exception as exc:
            hint = ("the model fixes a dim the shape profile lets vary: make that dim static in the profile, or change "
                    "the model" if "Constraints violated" in str(exc) else "fix the graph break it names")
            raise OverdriveError(f"torch.export failed for this model ({type(exc).__name__}: {str(exc)[:400]}); "
                                 f"try --backend onnxruntime, or {hint}") from exc
    t_export = time.perf_counter() - t0
    shared = check_exported_dims(ep, list(cfg.profiles), src.input_names) if dyn else []
    dropped = (drop_constant_attention_masks(ep, _corner_inputs(example, cfg.profiles, src.input_names))
               if cfg.drop_constant_masks else [])
    gelus = fuse_gemm_gelu(ep) if use_gemm_gelu(cfg, device) else []
    cuda = device.type == "cuda"
    choice = TimedChoice(device) if cuda else None  # per shape: fused where it wins on this GPU
    convs = fuse_conv_relu(ep, choice) if use_conv_fusion(cfg, device) else []
    groups = TimedGroups(device) if cuda else None
    siblings = fuse_sibling_gemms(ep, groups) if use_sibling_gemms(cfg, device, use_freezing(cfg, device)) else []
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    sections = {"exported_program": buf.getvalue()}
    mode = _mode(cfg, device)
    freezing = use_freezing(cfg, device)
    meta: dict[str, Any] = {"compile_mode": mode, "export_s": t_export, "dynamic": dyn is not None, "freezing": freezing,
                            "shared_dims": shared, "attention_masks_dropped": len(dropped), "gemm_gelu_fused": len(gelus),
                            "conv_relu_fused": len(convs),
                            "conv_relu_timed": sorted({v[1] for v in choice.verdicts.values()}) if choice else [],
                            "sibling_gemms_fused": len(siblings),
                            "sibling_gemms_timed": sorted({v[1] for v in groups.verdicts.values()}) if groups else [],
                            "fp32_precision": fp32}  # applied again at load
    if cfg.precision in ("int8", "fp8"):  # what the layers without an int8/fp8 kernel run in
        rem = remainder_dtype(cfg.precision, device) if src.onnx_bytes is None else None
        meta["float_remainder"] = str(rem or torch.float32).removeprefix("torch.")
    if cfg.precision == "int8":  # {}: an imported Q/DQ graph, computed as fake-quant float arithmetic
        meta["int8_ops"] = int8_gemms(module)
    kept = getattr(module.model, "_overdrive_kept_float", None)
    if kept is not None:
        meta["layers_kept_float"] = kept
    if aot_by_default(cfg, device):  # CPU: the AOTInductor package alone (loads about 2x faster than a recompile)
        t0 = time.perf_counter()
        sections["aoti_package"] = _aoti_package(ep, fp32, freezing)
        runner = _load_aoti(sections["aoti_package"], fp32)
        runner(*example)
        meta.update(compile_s=time.perf_counter() - t0, aot=True)
        return sections, runner, meta
    compiled = _compile(ep.module(), cfg, mode, dyn is not None, freezing)
    runner = Runner(compiled, fp32, mode, "torch.compile")
    t0 = time.perf_counter()
    for _ in range(3 if mode == "reduce-overhead" else 1):  # CUDA graphs record on the 2nd/3rd call
        runner(*example)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    meta["compile_s"] = time.perf_counter() - t0
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is not None:
        sections["compile_cache"] = artifacts[0]
    if cache_info is not None:
        save_timing_cache(cfg.timing_cache, artifacts[0] if artifacts is not None else None, cache_info)
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
        return open(path, "rb").read()


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
    fp32 = _check_fp32_flags(meta["fp32_precision"]) if "fp32_precision" in meta else fp32_flags(precision)
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
    return Runner(fn, fp32, mode, how)
