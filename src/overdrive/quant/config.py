"""Quantization recipes as typed dataclasses: presets, validation, and a JSON round trip.

Example:
    >>> from overdrive.quant.config import INT8_DEFAULT, QuantConfig
    >>> QuantConfig.from_json(INT8_DEFAULT.to_json()) == INT8_DEFAULT
    True
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError

FORMATS = ("int8", "fp8_e4m3")
METHODS = ("max", "percentile", "entropy", "mse")
# "Conv1D" is Hugging Face's GPT-2 projection (transformers.pytorch_utils.Conv1D: a Linear with weight (in, out));
# "Conv1d" is torch.nn.Conv1d
LAYER_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "Conv1D")
DYNAMIC_LAYER_TYPES = ("Linear", "Conv1D")  # the layers whose input rows are tokens: per-token dynamic scales
# The largest representable magnitude of each format: int8 scale = amax/127, fp8 e4m3 scale = amax/448.
FORMAT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}


@dataclass(frozen=True)
class QuantizerConfig(ConfigBase):
    """How one tensor is quantized: format, per-channel or per-tensor, narrow range, on/off.

    ``per_channel`` means one scale per output channel for weights (axis 0 for Linear/Conv, axis 1
    for ConvTranspose and Hugging Face's Conv1D); calibrated activations are per tensor. ``narrow_range`` uses
    [-127, 127] (TensorRT's symmetric weights) instead of [-128, 127]. ``dynamic`` (layer inputs only): one scale per
    token (each row over the last dimension), amax / bound computed from every input as it comes, so there is
    nothing to calibrate (ONNX Runtime's and ModelOpt's dynamic mode; ``INT8_DYNAMIC``).

    Example:
        >>> QuantizerConfig(dynamic=True).to_json()
        '{"format": "int8", "per_channel": false, "narrow_range": false, "enabled": true, "dynamic": true}'
    """

    format: str = "int8"
    per_channel: bool = False
    narrow_range: bool = False
    enabled: bool = True
    dynamic: bool = False

    _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("dynamic",)  # written only when set: older JSON reads the same

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise UsageError(f"quantizer format {self.format!r} is not one of {FORMATS}; pick one of those")
        for flag in ("per_channel", "narrow_range", "enabled", "dynamic"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"QuantizerConfig {flag}={getattr(self, flag)!r} must be True or False")
        if self.dynamic and self.per_channel:
            raise UsageError("QuantizerConfig(dynamic=True, per_channel=True): a dynamic quantizer has one scale per "
                             "token already; drop per_channel")

    @property
    def bound(self) -> float:
        return FORMAT_MAX[self.format]


def check_alpha(alpha: object) -> float:
    """A SmoothQuant alpha as a float in [0, 1], or a UsageError that names it."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise UsageError(f"SmoothQuant alpha={alpha!r} must be a number in [0, 1] (0.5 is the paper's "
                         "default, 1.0 ModelOpt's; larger moves more of the outliers into the weights)")
    return float(alpha)


def check_percentile(percentile: object) -> float:
    """A calibration percentile as a float in (50, 100], or a UsageError that names it.

    It is a percent (99.99 keeps all but the top 0.01% of magnitudes): a fraction such as 0.9999 would clip every
    activation to the smallest values seen, and a value above 100 would silently mean max.

    Example:
        >>> check_percentile(99.9)
        99.9
    """
    if (isinstance(percentile, bool) or not isinstance(percentile, numbers.Real)
            or not 50.0 < float(percentile) <= 100.0):
        raise UsageError(f"percentile {percentile!r} must be a number in (50, 100]: a percent such as 99.99, not a "
                         "fraction such as 0.9999")
    return float(percentile)


def _check_names(owner: str, name: str, value: object) -> tuple[str, ...]:
    """``value`` (a tuple or list of strings, e.g. fnmatch patterns) as a tuple, or a UsageError naming it: a bare
    string would be read as one pattern per character (``exclude="fc2"`` -> 'f', 'c', '2', excluding nothing)."""
    if isinstance(value, str):
        raise UsageError(f"{owner} {name}={value!r} is a string; give a tuple of strings, e.g. {name}=({value!r},)")
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(f"{owner} {name}={value!r} must be a tuple of strings, e.g. {name}=('fc2',)") from None
    bad = [v for v in items if not isinstance(v, str)]
    if bad:
        raise UsageError(f"{owner} {name}={value!r} holds non-string item(s) {bad}; give module names / patterns as "
                         f"strings, e.g. {name}=({str(bad[0])!r},)")
    return items


@dataclass(frozen=True)
class QuantConfig(ConfigBase):
    """What ``quantize`` does: the input and weight quantizers, the calibrator, and layer selection.

    Layers are selected by type (``layer_types``, class names) and by name: a module whose dotted
    name matches any ``exclude`` fnmatch pattern stays in float (e.g. ``("stem.*", "fc2")`` keeps
    the first conv and the classifier in float); ``include`` restricts to matching names.
    ``residual_add`` inserts a quantizer on the residual input of ``x + y`` adds (torch.fx, see
    README) so TensorRT can fuse the add into the conv. ``quantize_matmuls`` (opt-in) puts a
    per-tensor input quantizer on both operands of every activation-by-activation matmul in forward
    code (``q @ k.transpose(-2, -1)``, ``attn @ v``, ``torch.bmm``) and on q, k, v of
    ``F.scaled_dot_product_attention`` (TensorRT's rule: quantize the inputs of attention's BMMs).
    ``smoothquant`` (alpha in [0, 1], None: off) migrates activation outliers into the weights per input
    channel of every Linear / GPT-2 Conv1D before calibration (``quant.smoothquant``; ``INT8_SMOOTHQUANT``).

    Example:
        >>> cfg = QuantConfig(method="percentile", percentile=99.99, exclude=("fc2",))
        >>> cfg.input.format, cfg.weight.per_channel
        ('int8', True)
    """

    input: QuantizerConfig = field(default_factory=QuantizerConfig)
    weight: QuantizerConfig = field(default_factory=lambda: QuantizerConfig(per_channel=True, narrow_range=True))
    method: str = "max"
    percentile: float = 99.99
    num_bins: int = 2048
    layer_types: tuple[str, ...] = LAYER_TYPES
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    residual_add: bool = True
    quantize_matmuls: bool = False
    smoothquant: float | None = None

    _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("smoothquant",)  # written only when set: older JSON reads the same
    _JSON_INDENT = 2  # recipes are saved for people to read and edit

    def __post_init__(self) -> None:
        for name in ("input", "weight"):
            value = getattr(self, name)
            if not isinstance(value, QuantizerConfig):
                raise UsageError(f"QuantConfig {name}={value!r} must be a QuantizerConfig, e.g. "
                                 f"{name}=QuantizerConfig(format='fp8_e4m3')")
        if self.method not in METHODS:
            raise UsageError(f"calibration method {self.method!r} is not one of {METHODS}; pick one of those")
        check_percentile(self.percentile)
        if isinstance(self.num_bins, bool) or not isinstance(self.num_bins, int) or self.num_bins < 128:
            raise UsageError(f"num_bins {self.num_bins!r} must be an int >= 128 (the entropy method merges into 128 "
                             "bins), e.g. 2048")
        for name in ("layer_types", "include", "exclude"):  # JSON gives lists; keep the config hashable
            object.__setattr__(self, name, _check_names("QuantConfig", name, getattr(self, name)))
        for flag in ("residual_add", "quantize_matmuls"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"{flag}={getattr(self, flag)!r} must be True or False")
        if self.smoothquant is not None:
            object.__setattr__(self, "smoothquant", check_alpha(self.smoothquant))
        if self.weight.dynamic:
            raise UsageError("QuantConfig(weight=QuantizerConfig(dynamic=True)): weights are constants, calibrated "
                             "once; dynamic applies to input= (per-token activation scales)")
        if self.input.dynamic:
            convs = [t for t in self.layer_types if t not in DYNAMIC_LAYER_TYPES]
            if convs:
                raise UsageError(f"dynamic per-token input scales apply to {DYNAMIC_LAYER_TYPES} only (a token is a "
                                 f"row over the last dimension), not layer_types {convs}; give "
                                 f"layer_types={DYNAMIC_LAYER_TYPES} (INT8_DYNAMIC does) or a static input config")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise UsageError(f"layer type(s) {bad} cannot be quantized; supported: {LAYER_TYPES}")


@dataclass(frozen=True)
class RealConfig(ConfigBase):
    """What ``to_real`` does: fp8 scales per row or per tensor, and the device the GEMM modules are built for.

    ``rowwise`` (fp8 only): dynamic per-token activation scales and per-channel weight scales, instead of
    static per-tensor ones. ``device``: where the converted model will run ("cuda", "cpu", ...), which decides
    whether fp8 is possible; None: the model's device. A ``torch.device`` is stored as its string.
    ``linear_kernel``: what runs a statically calibrated Linear layer: ``"cublas"`` (``torch._int_mm`` /
    ``torch._scaled_mm``), or ``"triton"`` (the convolution kernel on the 1x1 view, ``Int8TritonLinear``, whose
    epilogue can take the activation after it and the next layer's quantize in an engine; int8/fp8 engines on CUDA
    ask for it and time both per layer).

    Example:
        >>> RealConfig.from_json(RealConfig(rowwise=True, device="cuda").to_json())
        RealConfig(rowwise=True, device='cuda', linear_kernel='cublas')
    """

    rowwise: bool = False
    device: str | None = None
    linear_kernel: str = "cublas"

    _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("linear_kernel",)  # written only when set: older JSON reads the same

    def __post_init__(self) -> None:
        if not isinstance(self.rowwise, bool):
            raise UsageError(f"rowwise={self.rowwise!r} must be True or False")
        if self.linear_kernel not in ("cublas", "triton"):
            raise UsageError(f"linear_kernel={self.linear_kernel!r}: expected 'cublas' (torch._int_mm / _scaled_mm) or "
                             "'triton' (the convolution kernel, epilogue fusable)")
        object.__setattr__(self, "device", _device_name(self.device))


@dataclass(frozen=True)
class WeightOnlyConfig(ConfigBase):
    """What ``weight_only`` does: int8 or int4 weights with one fp scale per ``group_size`` inputs, for
    ``nn.Linear`` layers whose in and out features are both >= ``min_features`` and whose dotted name matches
    no ``exclude`` fnmatch pattern (e.g. ``("lm_head",)``).

    Example:
        >>> WeightOnlyConfig(bits=4, group_size=64, exclude=["lm_head"]).exclude
        ('lm_head',)
    """

    bits: int = 8
    group_size: int = 128
    min_features: int = 256
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or isinstance(self.bits, bool):
            raise UsageError(f"weight-only bits={self.bits!r} must be 4 or 8")
        for name in ("group_size", "min_features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "group_size" else 0):
                what = "> 0 and divide in_features (e.g. 32, 64, 128)" if name == "group_size" else ">= 0"
                raise UsageError(f"{name}={value!r} must be an int {what}")
        if isinstance(self.exclude, str):
            raise UsageError(f"exclude={self.exclude!r} is a string; give a tuple of name patterns, e.g. "
                             f"({self.exclude!r},)")
        object.__setattr__(self, "exclude", tuple(self.exclude))  # JSON gives a list; keep the config hashable


def _device_name(device: object) -> str | None:
    """A device as a string ('cuda:1'), checked by torch; None stays None."""
    if device is None:
        return None
    try:
        return str(torch.device(device))  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device={device!r} is not a torch device; use e.g. 'cuda', 'cuda:1' or 'cpu'") from exc


INT8_DEFAULT = QuantConfig()
"""int8: activations per tensor [-128, 127], weights per output channel [-127, 127], max calibration."""

FP8_DEFAULT = QuantConfig(
    input=QuantizerConfig(format="fp8_e4m3"),
    weight=QuantizerConfig(format="fp8_e4m3", per_channel=True),
)
"""fp8 e4m3: activations per tensor, weights per output channel, scale = amax / 448, max calibration."""

INT8_ATTENTION = INT8_DEFAULT.replace(quantize_matmuls=True)
"""INT8_DEFAULT plus int8 per-tensor quantizers on both inputs of attention's matmuls (QK^T, PV, SDPA's q/k/v)."""

INT8_SMOOTHQUANT = INT8_DEFAULT.replace(smoothquant=0.5)
"""INT8_DEFAULT after SmoothQuant (alpha 0.5): per-input-channel factors move activation outliers into the weights
(ModelOpt's INT8_SMOOTHQUANT_CFG)."""

INT8_DYNAMIC = QuantConfig(input=QuantizerConfig(dynamic=True), layer_types=DYNAMIC_LAYER_TYPES, residual_add=False)
"""int8 with dynamic per-token activation scales (amax of each row at run time, no calibration data needed) and
per-output-channel weights, for Linear / GPT-2 Conv1D layers: the most accurate int8 for transformers, whose
activations have outlier tokens that a per-tensor scale must cover. Real kernels: ``to_real`` (``torch._int_mm``
with per-row scales); no ONNX Q/DQ form (QuantizeLinear takes a fixed scale)."""

INT8_DYNAMIC_SMOOTHQUANT = INT8_DYNAMIC.replace(smoothquant=0.5)
"""INT8_DYNAMIC after SmoothQuant (alpha 0.5; its per-channel activation maxima come from the ``forward_loop``):
per-token scales handle the outlier tokens, the smoothing the outlier channels. The most accurate int8 here on a
pretrained encoder (all-MiniLM-L6-v2: cosine 0.999, kNN@10 0.963 against fp32, ``benchmarks/quant_pretrained.py``);
``to_real`` runs it as int8 GEMMs with the 1 / s factors applied in the quantize step."""

PRESETS: dict[str, QuantConfig] = {"int8": INT8_DEFAULT, "fp8": FP8_DEFAULT, "int8_attention": INT8_ATTENTION,
                                   "int8_smoothquant": INT8_SMOOTHQUANT, "int8_dynamic": INT8_DYNAMIC,
                                   "int8_dynamic_smoothquant": INT8_DYNAMIC_SMOOTHQUANT}


def get_preset(name: str) -> QuantConfig:
    """A preset by name: one of :data:`PRESETS` ('int8', 'fp8', 'int8_attention', 'int8_smoothquant',
    'int8_dynamic', 'int8_dynamic_smoothquant')."""
    if name not in PRESETS:
        raise UsageError(f"quantization config {name!r} is not one of {list(PRESETS)}; pick one of those")
    return PRESETS[name]
