"""Build settings for an engine: precision, backend, device and the input shape profiles.

Shapes follow trtexec: ``"input:8x3x224x224"`` for a static profile, or min/opt/max for a
dynamic one. A profile is per input; a dimension is dynamic when min != max.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError, close_names, did_you_mean

IO_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int32": "int32", "int64": "int64", "bool": "bool"}
IO_LAYOUTS = ("chw", "hwc", "hwc8")  # hwc / hwc8: channels_last for 4-D tensors (trtexec's names)
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8", "fp8", "best")
BACKENDS = ("auto", "inductor", "onnxruntime", "tensorrt")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
LAYER_PRECISIONS = ("timed", "all")  # int8/fp8 layers: kept float where timed slower, or all low precision
LOWP_LINEARS = ("timed", "cublas")  # int8/fp8 Linear layers on CUDA: Triton / cuBLAS / float by timing, or no Triton
INT8_ACTIVATIONS = ("static", "dynamic")  # int8 activation scales: calibrated once, or per token at run time
_BINDING_KEYS = ("dtype", "layout")  # what an engine header's "inputs" entry adds to its profile


@dataclass(frozen=True)
class ShapeProfile(ConfigBase):
    """Allowed shapes of one input: every dim d satisfies min[d] <= d <= max[d]; opt is the tuned shape.

    Example:
        >>> p = ShapeProfile("x", (1, 3), (8, 3), (32, 3))
        >>> p.dynamic_dims()
        [0]
    """

    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        for key in ("min", "opt", "max"):  # lists (JSON, callers) become tuples: the profile stays hashable
            object.__setattr__(self, key, tuple(getattr(self, key)))
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise UsageError(f"shape profile for {self.name!r}: min {self.min}, opt {self.opt}, max {self.max} "
                             "must have the same rank")
        for lo, mid, hi in zip(self.min, self.opt, self.max):
            if not (1 <= lo <= mid <= hi):
                raise UsageError(f"shape profile for {self.name!r}: need 1 <= min <= opt <= max in every dim, "
                                 f"got min {self.min}, opt {self.opt}, max {self.max}")

    @property
    def static(self) -> bool:
        return self.min == self.max

    def dynamic_dims(self) -> list[int]:
        return [i for i, (lo, hi) in enumerate(zip(self.min, self.max)) if lo != hi]

    def contains(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.min) and all(lo <= d <= hi for d, lo, hi in zip(shape, self.min, self.max))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShapeProfile:
        """A profile from its dict, or from an engine header's "inputs" entry (which adds dtype and layout)."""
        if isinstance(d, Mapping):
            d = {k: v for k, v in d.items() if k not in _BINDING_KEYS}
        return super().from_dict(d)

    @classmethod
    def fixed(cls, name: str, shape: tuple[int, ...]) -> ShapeProfile:
        return cls(name, tuple(shape), tuple(shape), tuple(shape))


def shapes_arg(shapes: dict[str, str]) -> str:
    """A ``--shapes`` value that pastes into a shell and parses back to these names: a name holding ``:``, a space or
    a quote is single-quoted for the shape parser (trtexec's ``'input:0':1x3``), and the whole value is quoted for
    the shell when it holds anything the shell would split or expand.

    Example:
        >>> print(shapes_arg({"x": "1x3"}), shapes_arg({"in put:0": "1x4", "b": "2"}))
        x:1x3 "'in put:0':1x4,b:2"
    """
    import re
    import shlex

    value = ",".join(f"'{n}':{d}" if re.search(r"[:\s'\"]", n) else f"{n}:{d}" for n, d in shapes.items())
    if re.fullmatch(r"[\w@%+=:,./x-]+", value):
        return value
    if not re.search(r'["$`\\!]', value):
        return f'"{value}"'
    return shlex.quote(value)


def check_all_dynamic_shapes(profiles: list[ShapeProfile], shapes: dict[str, tuple[int, ...]] | None) -> None:
    """Refuse ``--shapes`` that sets some inputs but leaves another dynamic input at its opt shape: a token model's
    mask then disagrees with its ids (``input_ids:4x16`` beside an ``attention_mask`` at 8x8), and the run fails
    deep in the engine with a broadcast error that names neither.

    Example:
        >>> ps = [ShapeProfile("ids", (1, 1), (8, 8), (8, 64)), ShapeProfile("mask", (1, 1), (8, 8), (8, 64))]
        >>> check_all_dynamic_shapes(ps, {"ids": (4, 16)})
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --shapes gives ids but not 'mask', whose shape is dynamic (1x1 to 8x64); give every dynamic input its shape, e.g. --shapes ids:4x16,mask:...
    """
    if not shapes:
        return
    missing = [p for p in profiles if p.name not in shapes and tuple(p.min) != tuple(p.max)]
    if missing:
        p = missing[0]
        example = shapes_arg({**{n: "x".join(map(str, s)) for n, s in shapes.items()}, p.name: "..."})
        raise UsageError(f"--shapes gives {', '.join(shapes)} but not {p.name!r}, whose shape is dynamic "
                         f"({'x'.join(map(str, p.min))} to {'x'.join(map(str, p.max))}); give every dynamic input its "
                         f"shape, e.g. --shapes {example}")


def parse_shapes(spec: str | None) -> dict[str, tuple[int, ...]]:
    """Parse trtexec's ``name:AxBxC,name2:D`` into ``{name: (A, B, C), ...}``.

    Example:
        >>> parse_shapes("x:8x3x224x224,mask:8x128")
        {'x': (8, 3, 224, 224), 'mask': (8, 128)}
    """
    out: dict[str, tuple[int, ...]] = {}
    if not spec:
        return out
    for item in spec.split(","):
        item = item.strip()
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise UsageError(f"shape {item!r} is not name:AxBxC (for example input:8x3x224x224)")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError as exc:
            raise UsageError(f"shape {item!r}: dims {dims!r} must be integers joined by 'x', like 8x3x224x224") from exc
        if any(d < 0 for d in shape):  # exec made the tensor and failed in torch, exit 1
            raise UsageError(f"shape {item!r}: dims must be >= 0, got {dims!r}")
        name = name.strip("'\"")
        if name in out:  # one of the two would be dropped silently
            raise UsageError(f"shape spec {spec!r} gives input {name!r} twice ({'x'.join(map(str, out[name]))} and "
                             f"{dims}); give each input once")
        out[name] = shape
    return out


def parse_io_formats(spec: str | list[str] | None) -> list[str]:
    """trtexec's ``--inputIOFormats`` / ``--outputIOFormats``: ``fp16:chw,fp32:chw`` -> ``["fp16:chw", "fp32:chw"]``.

    One entry per tensor in order, or one entry for all. Types: fp32, fp16, bf16, int32, int64, bool;
    layouts: chw (contiguous), hwc / hwc8 (channels_last for 4-D tensors).

    Example:
        >>> parse_io_formats("fp16:hwc,int64:chw")
        ['fp16:hwc', 'int64:chw']
    """
    if not spec:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        item = item.strip().lower()
        dtype, sep, layout = item.partition(":")
        layout = layout or "chw"
        if dtype not in IO_DTYPES or layout not in IO_LAYOUTS:
            types = [dtype] if dtype in IO_DTYPES else close_names(dtype, IO_DTYPES)
            layouts = [layout] if layout in IO_LAYOUTS else close_names(layout, IO_LAYOUTS)
            near = f"; did you mean {types[0]}:{layouts[0]}?" if types and layouts else ""
            raise UsageError(f"I/O format {item!r} (--inputIOFormats / --outputIOFormats) is not type:layout with type "
                             f"one of {', '.join(IO_DTYPES)} and layout one of {', '.join(IO_LAYOUTS)} (for example "
                             f"fp16:chw){near}")
        out.append(f"{dtype}:{layout}")
    return out


def profiles_from_shapes(shapes: str | dict | None = None, min_shapes: str | dict | None = None,
                         opt_shapes: str | dict | None = None, max_shapes: str | dict | None = None) -> list[ShapeProfile]:
    """Build per-input profiles from trtexec-style ``--shapes`` or ``--min/opt/max-shapes``."""
    def as_dict(s: str | dict | None) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v) for k, v in s.items()} if isinstance(s, dict) else parse_shapes(s)

    fixed, lo, mid, hi = as_dict(shapes), as_dict(min_shapes), as_dict(opt_shapes), as_dict(max_shapes)
    if fixed and (lo or mid or hi):
        raise UsageError("give either --shapes or --min-shapes/--opt-shapes/--max-shapes, not both")
    if fixed:
        return [ShapeProfile.fixed(n, s) for n, s in fixed.items()]
    if mid and not (lo or hi):  # trtexec: --optShapes alone is a static profile at those shapes
        return [ShapeProfile.fixed(n, s) for n, s in mid.items()]
    if not (lo or hi):
        return []
    if set(lo) != set(hi):
        raise UsageError(f"--min-shapes names {sorted(lo)} and --max-shapes names {sorted(hi)} must be the same inputs")
    if set(mid) - set(lo):
        raise UsageError(f"--opt-shapes names {sorted(set(mid) - set(lo))}, which --min-shapes/--max-shapes do not "
                         f"give ({sorted(lo)}); name the same inputs in all three")
    return [ShapeProfile(n, lo[n], mid.get(n, hi[n]), hi[n]) for n in lo]


@dataclass(frozen=True)
class BuildConfig(ConfigBase):
    """How to build an engine.

    ``precision`` is the compute precision (inputs and outputs stay float32, like trtexec's default I/O);
    ``compile_mode`` is Inductor's mode; unset, a static CUDA profile runs as one CUDA graph around the whole program
(the inductor backend's ``GraphRunner``), a dynamic one under "reduce-overhead" (a graph per shape met).
    ``int8_activations`` (int8 only) says where the activation scales come from: ``"static"``, one scale per
    tensor calibrated on ``calib`` batches (Q/DQ); ``"dynamic"``, one scale per token (row) computed at run time,
    weights int8 per output channel, no calibration needed (CPU: onnxruntime's ``quantize_dynamic``, or per-row
    ``torch._int_mm`` on the inductor backend); None: dynamic for a CPU build without calibration data, static
    otherwise. The engine header's ``config`` holds the mode chosen.
    ``layer_precision`` (int8/fp8 from a PyTorch model): ``"timed"`` times each int8/fp8 GEMM layer against its
    float twin at build time and keeps the float one where it is faster, as TensorRT's tactic selection does
    (``engine.info["layers_kept_float"]`` lists them and why); ``"all"`` keeps every supported layer low-precision.
    ``quantize_residuals`` (int8/fp8 convolutions on CUDA): a float residual add whose input is also quantized for a
    convolution (a ResNet block's input) reads that 8-bit tensor, so blocks hand over only 8-bit tensors (one byte
    per element each way); the residual then carries 8-bit rounding, as in pytorch-quantization's and TensorRT's int8
    ResNets. Off by default. Residual adds the calibration quantized (``quant``'s residual-add quantizers, on in the
    build's own calibration) are read in 8 bits without it.
    ``lowp_linears`` (int8/fp8 Linear layers on CUDA, with ``layer_precision="timed"``): ``"timed"`` times each one
    on the Triton kernel with its activation and the next quantize fused, on cuBLAS's GEMM and in float, and keeps
    the fastest; ``"cublas"`` leaves the Triton kernel out (cuBLAS or float, as builds did before it).
    ``allow_tf32`` (trtexec's ``--noTF32`` when False): the layers an fp16/bf16/int8/fp8 CUDA engine leaves in fp32
    run TF32 on cuBLAS and cuDNN by default, as TensorRT's do; False keeps them IEEE fp32 (the engine header's
    ``backend_meta["fp32_precision"]`` records the flags). fp32 engines run IEEE fp32 always, CPU engines too
    (oneDNN); 'tf32' with False is refused.
    ``timing_cache`` (trtexec's ``--timingCacheFile``) is a file that carries Inductor's compile cache from
    one build to the next: loaded before compiling when it exists, rewritten after the build. It has no
    effect on the onnxruntime backend (a warning says so). A cache unpickles when loaded, so one not signed
    with the user's key (overdrive._utils.signing) is ignored unless ``trust_timing_cache`` is set. Configs are frozen: change one with
    ``cfg.replace(...)``; named presets are in ``PRESETS`` (:func:`get_preset`).

    Example:
        >>> cfg = BuildConfig(precision="fp16", device="cuda")
        >>> BuildConfig.from_json(cfg.to_json()) == cfg
        True
    """

    precision: str = "fp32"
    backend: str = "auto"
    device: str = "cpu"
    profiles: tuple[ShapeProfile, ...] = ()  # lists and dicts (JSON) are accepted and become a tuple of profiles
    compile_mode: str | None = None  # None: one CUDA graph (static CUDA), reduce-overhead (dynamic CUDA), default (CPU)
    aot: bool | None = None  # AOTInductor package; None: alone for CPU builds where it loads (torch >= 2.12), off on CUDA
    channels_last: bool = True  # 4-D inputs of CNNs on CUDA run faster in NHWC
    opset: int = 18
    timing_cache: str | None = None  # a file kept across builds (Inductor's compile cache); None: no file
    trust_timing_cache: bool = False  # load a timing cache not signed with this user's key (it unpickles)
    input_io_formats: tuple[str, ...] = ()  # trtexec --inputIOFormats; (): fp32:chw (as given)
    output_io_formats: tuple[str, ...] = ()  # trtexec --outputIOFormats; (): fp32 outputs
    freezing: bool | None = None  # Inductor freezing (weights as constants: conv+BN folded); None: on for CUDA
    gemm_gelu: bool | None = None  # GELU after a Linear folded into the GEMM's epilogue (cuBLASLt); None: on for CUDA
    conv_fusion: bool | None = None  # conv (+BN) (+add) + ReLU as one cuDNN call (fp16/bf16); None: static CUDA
    sibling_gemms: bool | None = None  # Linears reading one input as one GEMM, where timed faster; None: on for CUDA
    # (fp16/bf16 GEMMs; True also groups int8/fp8 Linears on the Triton kernel: groups_lowp_siblings)
    drop_constant_masks: bool = True  # remove attention masks built from constants that mask nothing (exact)
    int8_activations: str | None = None  # int8: "static" (calibrated) or "dynamic" (per token); None: see above
    layer_precision: str = "timed"  # int8/fp8: "timed" (a layer whose low-precision GEMM loses stays float) or "all"
    quantize_residuals: bool = False  # int8/fp8 CNNs on CUDA: residual adds read the block input's 8-bit tensor
    lowp_linears: str = "timed"  # int8/fp8 Linears on CUDA: "timed" (Triton, cuBLAS or float) or "cublas" (no Triton)
    allow_tf32: bool = True  # fp16/bf16/int8/fp8 on CUDA: the fp32 layers may run TF32; False: IEEE fp32 (--noTF32)
    _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("trust_timing_cache", "int8_activations", "layer_precision",
                                                 "conv_fusion", "sibling_gemms", "quantize_residuals", "lowp_linears",
                                                 "allow_tf32")

    def groups_siblings(self, device_type: str) -> bool:
        """Whether this build runs sibling Linear layers (Q/K/V, gate/up) as one GEMM on ``device_type`` (``"cuda"``,
        ``"cpu"``), in float and in int8/fp8: ``sibling_gemms`` (None: on for CUDA), and only with Inductor freezing
        on (``freezing``; None: on for CUDA), which computes the concatenated weights once.

        Example:
            >>> BuildConfig().groups_siblings("cpu"), BuildConfig().groups_siblings("cuda")
            (False, True)
        """
        cuda = device_type == "cuda"
        freezing = self.freezing if self.freezing is not None else cuda
        return freezing and (self.sibling_gemms if self.sibling_gemms is not None else cuda)

    def groups_lowp_siblings(self, device_type: str) -> bool:
        """Whether this int8/fp8 build also runs sibling Linear layers on the Triton kernel as one GEMM
        (``engine/lowp_siblings.py``): only with ``sibling_gemms=True`` given (``--sibling-gemms``), while that
        path has no GPU measurement behind it as a default; with freezing, as :meth:`groups_siblings`.

        Example:
            >>> BuildConfig().groups_lowp_siblings("cuda"), BuildConfig(sibling_gemms=True).groups_lowp_siblings("cuda")
            (False, True)
        """
        return self.sibling_gemms is True and self.groups_siblings(device_type)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UsageError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}"
                             f"{did_you_mean(self.precision, PRECISIONS, list_up_to=0)}")
        if self.backend not in BACKENDS:
            raise UsageError(f"backend={self.backend!r} is not one of {', '.join(BACKENDS)}"
                             f"{did_you_mean(self.backend, BACKENDS, list_up_to=0)}")
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise UsageError(f"compile_mode={self.compile_mode!r} is not one of {', '.join(COMPILE_MODES)}"
                             f"{did_you_mean(self.compile_mode, COMPILE_MODES, list_up_to=0)}")
        if self.layer_precision not in LAYER_PRECISIONS:
            raise UsageError(f"layer_precision {self.layer_precision!r} (--layer-precision) is not one of "
                             f"{', '.join(LAYER_PRECISIONS)}: 'timed' keeps a layer float where its int8/fp8 GEMM is "
                             "slower, 'all' runs every supported layer in the build precision")
        if self.lowp_linears not in LOWP_LINEARS:
            raise UsageError(f"lowp_linears {self.lowp_linears!r} (--lowp-linears) is not one of "
                             f"{', '.join(LOWP_LINEARS)}: 'timed' times each int8/fp8 Linear on the Triton kernel "
                             "(epilogue fused), on cuBLAS and in float; 'cublas' leaves the Triton kernel out")
        if self.int8_activations is not None:
            if self.int8_activations not in INT8_ACTIVATIONS:
                raise UsageError(f"int8_activations={self.int8_activations!r} is not one of "
                                 f"{', '.join(INT8_ACTIVATIONS)} (or None: dynamic without calibration data on CPU, "
                                 f"else static){did_you_mean(self.int8_activations, INT8_ACTIVATIONS, list_up_to=0)}")
            if self.precision == "fp8" and self.int8_activations == "dynamic":
                raise UsageError("int8_activations='dynamic' is for precision='int8': fp8 engines use calibrated "
                                 "per-tensor scales; drop it, or build int8")
            if self.precision not in ("int8", "best"):
                raise UsageError(f"int8_activations={self.int8_activations!r} applies to int8 engines, but this "
                                 f"build has precision={self.precision!r}; give precision='int8' (or 'best'), or drop "
                                 "it")
        if not isinstance(self.allow_tf32, bool):
            raise UsageError(f"allow_tf32 {self.allow_tf32!r} is not a bool: True lets the fp32 layers of a "
                             "fp16/bf16/int8/fp8 CUDA engine run TF32, False keeps them IEEE fp32 (trtexec's --noTF32)")
        if self.precision == "tf32" and not self.allow_tf32:
            raise UsageError("allow_tf32=False (--noTF32) and precision='tf32' ask for opposite fp32 math; give "
                             "precision='fp32' (IEEE fp32, which allow_tf32=False asks for) or drop allow_tf32=False")
        if self.quantize_residuals and self.precision not in ("int8", "fp8", "best"):
            raise UsageError(f"quantize_residuals (--quantize-residuals) applies to int8 / fp8 engines, but the "
                             f"precision is {self.precision}; give --int8 or --fp8, or drop the flag")
        profiles = tuple(p if isinstance(p, ShapeProfile) else ShapeProfile.from_dict(p) for p in self.profiles)
        object.__setattr__(self, "profiles", profiles)
        object.__setattr__(self, "input_io_formats", tuple(parse_io_formats(self.input_io_formats)))
        object.__setattr__(self, "output_io_formats", tuple(parse_io_formats(self.output_io_formats)))


FP32_DEFAULT = BuildConfig(precision="fp32")
FP16_CUDA = BuildConfig(precision="fp16", device="cuda")
BF16_CUDA = BuildConfig(precision="bf16", device="cuda")
PRESETS: dict[str, BuildConfig] = {"fp32": FP32_DEFAULT, "fp16_cuda": FP16_CUDA, "bf16_cuda": BF16_CUDA}


def get_preset(name: str) -> BuildConfig:
    """A preset by name ('fp32', 'fp16_cuda' or 'bf16_cuda'); change it with ``.replace(...)``.

    Example:
        >>> get_preset("fp16_cuda").replace(device="cuda:1").precision
        'fp16'
    """
    if name not in PRESETS:
        raise UsageError(f"build preset {name!r} is not one of {list(PRESETS)}; pick one of those")
    return PRESETS[name]
