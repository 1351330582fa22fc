"""The mixed-precision policy: one typed config behind both the apex surface and the native API."""

from __future__ import annotations

import math

import dataclasses
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, ClassVar, Literal

import torch

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError
from overdrive.amp.guard import ON_NONFINITE
from overdrive.amp.scaler import WARN_AFTER_SKIPS

OPT_LEVELS = ("O0", "O1", "O2", "O3")
_HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "float16": "float16", "bfloat16": "bfloat16"}

LossScale = float | Literal["dynamic"]
FP8_RECIPES = ("tensorwise", "rowwise")
# fp8 GEMMs need both matrix dims to be multiples of 16 (cuBLASLt's fp8 layout rule)
FP8_ALIGN = 16


def parse_dtype(value: torch.dtype | str | None, what: str = "dtype") -> torch.dtype | None:
    """Accept torch.float16/bfloat16 or their names ('fp16', 'bf16', 'float16', ...)."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _HALF_DTYPES.values():
            raise UsageError(f"{what}={value} is not a half dtype; use torch.float16 or torch.bfloat16")
        return value
    key = _DTYPE_ALIASES.get(str(value).lower().removeprefix("torch."))
    if key is None:
        raise UsageError(f"{what}={value!r} is not a half dtype; use 'fp16'/'float16' or 'bf16'/'bfloat16'")
    return _HALF_DTYPES[key]


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Fp8(ConfigBase):
    """fp8 training of the Linear layers big enough to gain; the rest of the model keeps the O-level's half dtype.

    Chosen layers run their forward GEMM and both backward GEMMs in fp8 with dynamic scaling (a scale
    from each tensor's current absolute maximum, every step), through torchao's float8 training:

    - ``recipe="tensorwise"``: one scale per tensor; e4m3 for inputs and weights, e5m2 for gradients.
      The fastest recipe.
    - ``recipe="rowwise"``: one scale per row (per token for activations, per output channel for
      weights), power-of-two scales, e4m3 everywhere. More accurate with outliers, somewhat slower.

    Which Linear layers (by their name in ``model.named_modules()``) train in fp8, in this order:
    a name matching an ``include`` pattern (fnmatch, e.g. ``"*.mlp.*"``) does, a name matching an
    ``exclude`` pattern does not, and any other layer does when both its ``in_features`` and
    ``out_features`` are at least ``min_features`` and its weight has at least ``min_weight`` elements
    (a smaller GEMM loses more to the casts than fp8's doubled tensor-core rate wins back; ``min_features=0,
    min_weight=0`` turns the size rule off). The defaults are measured (benchmarks/amp_fp8.py, sweep, H200,
    16k tokens, compiled fwd + bwd, tensorwise vs bf16): 2048x8192 1.18x, 4096x4096 1.21x, but 2048x2048
    0.81x, 1024x4096 0.91x and 768x3072 0.52x, so a layer needs 2048 on its short side and 2^24 weights. In every
    case both dims must be multiples of 16, which fp8 GEMMs require. ``exclude=("*",)`` with an
    ``include`` list converts only the layers it names. ``amp.summary(model)`` lists the choice.

    fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell); ``emulate=True``
    runs the same casts with the GEMMs in fp32 on any device, for checking numerics (it is not fast).

    Example:
        >>> f = Fp8(recipe="rowwise", exclude=["lm_head"])
        >>> f.exclude, f.chooses("blocks.0.mlp.fc1", 4096, 4096), f.chooses("lm_head", 4096, 32000)
        (('lm_head',), (True, 'fp8 (rowwise)'), (False, "excluded by pattern 'lm_head'"))
        >>> Fp8.from_json(f.to_json()) == f
        True
    """

    recipe: str = "tensorwise"
    emulate: bool = False
    min_features: int = 2048
    min_weight: int = 1 << 24  # in_features * out_features
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise UsageError(f"fp8 recipe {self.recipe!r} is not one of {', '.join(map(repr, FP8_RECIPES))} "
                             "(tensorwise: one scale per tensor, fastest; rowwise: one scale per row, more accurate)")
        if not isinstance(self.emulate, bool):
            raise UsageError(f"Fp8(emulate={self.emulate!r}) must be True or False")
        m = self.min_features
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise UsageError(f"Fp8(min_features={m!r}) must be an int >= 0 (0 converts every Linear whose dims are "
                             f"multiples of {FP8_ALIGN})")
        w = self.min_weight
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise UsageError(f"Fp8(min_weight={w!r}) must be an int >= 0 (in_features * out_features a layer needs "
                             "to train in fp8; 0 turns this part of the size rule off)")
        for what in ("include", "exclude"):
            value = getattr(self, what)
            patterns = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(x, str) and x for x in patterns):
                raise UsageError(f"Fp8({what}={value!r}) must be module-name patterns (fnmatch strings, e.g. 'lm_head' "
                                 "or '*.mlp.*')")
            object.__setattr__(self, what, patterns)

    def chooses(self, name: str, in_features: int, out_features: int) -> tuple[bool, str]:
        """Whether the Linear layer ``name`` of shape (in, out) trains in fp8 under this rule, and why."""
        if in_features % FP8_ALIGN or out_features % FP8_ALIGN:
            return False, f"{in_features}x{out_features}: fp8 GEMMs need both dims to be multiples of {FP8_ALIGN}"
        hit = next((p for p in self.include if fnmatchcase(name, p)), None)
        if hit is not None:
            return True, f"fp8 ({self.recipe}; included by pattern {hit!r})"
        hit = next((p for p in self.exclude if fnmatchcase(name, p)), None)
        if hit is not None:
            return False, f"excluded by pattern {hit!r}"
        small = min(in_features, out_features)
        if small < self.min_features:
            side = "in_features" if in_features <= out_features else "out_features"
            return False, f"{side} {small} < min_features {self.min_features} (too small a GEMM to gain)"
        if in_features * out_features < self.min_weight:
            return False, (f"{in_features}x{out_features} weight < min_weight {self.min_weight} (too small a GEMM to "
                           "gain)")
        return True, f"fp8 ({self.recipe})"


@dataclass(frozen=True)
class Policy(ConfigBase):
    """What an opt level switches on, spelled out. Unset fields (None) take the opt level's default.

    | level | weights in model | forward           | master weights | loss scale (fp16 / bf16) |
    |-------|------------------|-------------------|----------------|--------------------------|
    | O0    | fp32             | fp32              | no             | 1 / 1                    |
    | O1    | fp32             | autocast (op-wise)| no             | dynamic / 1              |
    | O2    | half, norms fp32 | half              | fp32 copies    | dynamic / 1              |
    | O3    | half             | half              | no             | 1 / 1                    |

    Every level checks the gradients and the loss for inf/NaN before the optimizer steps. A step that
    has them is never applied: ``on_nonfinite="skip"`` (the default) skips it, counts it and warns (once
    per run of skipped steps, naming the step); ``"raise"`` raises an OverdriveError naming the step. A
    dynamic scale's overflow is routine (it backs off and skips quietly) until the scale is at its floor
    or the loss itself is inf/NaN. ``max_consecutive_skips`` skipped steps in a row (default 50, where the
    dynamic scaler used to warn) raise "training diverged"; None lets the run go on.

    ``fp8`` (an :class:`Fp8`, or its recipe name ``"tensorwise"`` / ``"rowwise"``) trains the large
    Linear layers in fp8 at O1-O3; the rest of the model runs as the level says.

    Example:
        >>> p = Policy(opt_level="O2", dtype=torch.bfloat16).resolve(torch.device("cpu"))
        >>> p.master_weights, p.keep_batchnorm_fp32, p.loss_scale
        (True, True, 1.0)
        >>> Policy.from_json(p.to_json()) == p
        True
    """

    opt_level: str = "O1"
    dtype: torch.dtype | None = None  # None: float16 on CUDA, bfloat16 on CPU
    cast_model_type: torch.dtype | None = None
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | None = None
    loss_scale: LossScale | None = None
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    # torch.amp.GradScaler's names and defaults: x growth_factor after growth_interval clean backwards, x backoff_factor
    # (and the step skipped) on inf/NaN
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    cast_model_outputs: torch.dtype | None = None  # None: float32 outputs when the model is cast
    # inf/NaN gradients or loss at a step no loss scale explains (see the class docstring)
    on_nonfinite: Literal["skip", "raise"] = "skip"
    max_consecutive_skips: int | None = WARN_AFTER_SKIPS
    fp8: Fp8 | None = None  # fp8 training of the large Linear layers (see Fp8)

    _JSON_SORT_KEYS = True  # the JSON form earlier versions wrote
    # fields added since: to_json writes them only when not at their default, so that a policy which leaves
    # them alone is written as before, and an earlier overdrive (which refuses unknown keys) still reads it
    _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ("on_nonfinite", "max_consecutive_skips", "fp8", "growth_factor",
                                                "backoff_factor")

    def __post_init__(self) -> None:
        if self.opt_level not in OPT_LEVELS:
            raise UsageError(
                f"opt_level {self.opt_level!r} is not one of {', '.join(OPT_LEVELS)} "
                "(O0 fp32, O1 autocast, O2 half model + fp32 masters, O3 pure half)"
            )
        object.__setattr__(self, "dtype", parse_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "cast_model_type", _parse_cast_type(self.cast_model_type))
        # parsed like cast_model_type, so a JSON round trip ('bfloat16') gives back a dtype
        object.__setattr__(self, "cast_model_outputs", _parse_cast_type(self.cast_model_outputs, "cast_model_outputs"))
        if isinstance(self.loss_scale, bool):  # True read as a static scale of 1.0: no scaling where one was meant
            raise UsageError(f"loss_scale={self.loss_scale!r} is a bool; pass 'dynamic' (a dynamic scale), a positive "
                             "number (a static scale) or None (the opt level's default)")
        if self.loss_scale is not None and self.loss_scale != "dynamic":
            try:
                scale = float(self.loss_scale)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"loss_scale={self.loss_scale!r} is neither 'dynamic' nor a number") from exc
            if not scale > 0 or scale == float("inf"):
                raise UsageError(f"loss_scale={self.loss_scale!r} must be a positive finite number or 'dynamic'")
            object.__setattr__(self, "loss_scale", scale)
        for what in ("min_loss_scale", "max_loss_scale"):
            value = getattr(self, what)
            if value is None and what == "min_loss_scale":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UsageError(f"{what}={value!r} must be a positive number" +
                                 (" or None (the default floor, 1)" if what == "min_loss_scale" else " (default 2**24)"))
        if self.min_loss_scale is not None and self.min_loss_scale > self.max_loss_scale:
            raise UsageError(f"min_loss_scale={self.min_loss_scale} exceeds max_loss_scale={self.max_loss_scale}")
        gi = self.growth_interval
        if isinstance(gi, bool) or not isinstance(gi, int) or gi < 1:
            raise UsageError(f"growth_interval={gi!r} must be an int >= 1 (clean steps before the loss scale grows)")
        for what, ok, expected in (("growth_factor", lambda v: v >= 1, ">= 1 (default 2.0)"),
                                   ("backoff_factor", lambda v: 0 < v < 1, "in (0, 1) (default 0.5)")):
            value = getattr(self, what)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not (number and ok(value)):
                raise UsageError(f"{what}={value!r} must be a number {expected}, as torch.amp.GradScaler's {what}")
            object.__setattr__(self, what, float(value))
        try:
            init = float(self.init_scale)
        except (TypeError, ValueError):
            init = math.nan
        if not (init > 0 and math.isfinite(init)):  # 0 divided by zero at the first step; NaN skipped 50 steps
            raise UsageError(f"init_scale={self.init_scale!r} must be a positive finite number (default 65536)")
        if self.keep_batchnorm_fp32 is not None and not isinstance(self.keep_batchnorm_fp32, bool):
            raise UsageError(f"keep_batchnorm_fp32={self.keep_batchnorm_fp32!r} must be True, False or None (the opt "
                             "level's default)")
        if self.master_weights is not None and not isinstance(self.master_weights, bool):
            raise UsageError(f"master_weights={self.master_weights!r} must be True, False or None (the opt level's "
                             "default: fp32 masters at O2 only)")
        if self.on_nonfinite not in ON_NONFINITE:
            raise UsageError(
                f"on_nonfinite={self.on_nonfinite!r} is not one of {', '.join(map(repr, ON_NONFINITE))} (skip: skip "
                "the step with inf/NaN gradients, count it and warn; raise: stop with an error naming the step)"
            )
        n = self.max_consecutive_skips
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UsageError(f"max_consecutive_skips={n!r} must be an int >= 1 (skipped steps in a row before the run "
                             "stops) or None (never stop)")
        if self.master_weights and self.opt_level == "O0":
            raise UsageError("master_weights=True needs a half model; O0 keeps fp32 weights (use O2)")
        object.__setattr__(self, "fp8", parse_fp8(self.fp8))
        if self.fp8 is not None and self.opt_level == "O0":
            raise UsageError("fp8 at opt_level 'O0' (pure fp32) mixes nothing; use opt_level='O2' with fp8, the "
                             "usual pairing (fp8 Linear layers, the rest in the half dtype, fp32 masters)")

    @classmethod
    def from_opt_level(cls, opt_level: str, **overrides: Any) -> Policy:
        """The preset for an apex opt level, with apex's keyword overrides."""
        return cls(opt_level=opt_level, **overrides)

    # --- the resolved view: every field concrete for one device -------------------------------
    def resolve(self, device: torch.device | str) -> Policy:
        """Fill every default for ``device`` and check the device can run the dtype."""
        device = torch.device(device)
        dtype = self.dtype or (torch.float16 if device.type == "cuda" else torch.bfloat16)
        lvl = self.opt_level
        if lvl != "O0":
            _check_dtype_on_device(dtype, device)
        if self.cast_model_type is not None:
            cast = self.cast_model_type
        else:
            cast = dtype if lvl in ("O2", "O3") else None
        cast = None if cast is torch.float32 else cast
        if cast is not None:
            _check_dtype_on_device(cast, device, "cast_model_type" if self.cast_model_type is not None else "dtype")
        if self.fp8 is not None:
            check_fp8_on_device(self.fp8, device)
        keep_bn = self.keep_batchnorm_fp32
        if keep_bn is None:
            keep_bn = lvl == "O2"
        masters = self.master_weights
        if masters is None:
            masters = lvl == "O2" and cast is not None
        if masters and cast is None:
            raise UsageError(f"master_weights=True at {lvl} needs a half model: set cast_model_type or use O2")
        scale = self.loss_scale
        if scale is None:
            fp16_anywhere = (lvl == "O1" and dtype is torch.float16) or (lvl == "O2" and cast is torch.float16)
            scale = "dynamic" if fp16_anywhere else 1.0
        outputs = self.cast_model_outputs or (torch.float32 if cast is not None else None)
        return dataclasses.replace(
            self, dtype=dtype, cast_model_type=cast, keep_batchnorm_fp32=keep_bn, master_weights=masters,
            loss_scale=scale, cast_model_outputs=outputs,
        )

    @property
    def autocast(self) -> bool:
        """O1 runs the forward under torch.autocast (op-level casting)."""
        return self.opt_level == "O1"

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"


def parse_fp8(value: Fp8 | str | bool | dict[str, Any] | None) -> Fp8 | None:
    """An :class:`Fp8` from itself, a recipe name, its dict form, True (the default rule) or None/False (off)."""
    if value is None or value is False:
        return None
    if value is True:
        return Fp8()
    if isinstance(value, Fp8):
        return value
    if isinstance(value, str):
        return Fp8(recipe=value.lower())
    if isinstance(value, dict):
        return Fp8.from_dict(value)
    raise UsageError(f"fp8={value!r} is not an fp8 setting; use 'tensorwise', 'rowwise', amp.Fp8(...) or None")


def check_fp8_on_device(fp8: Fp8, device: torch.device) -> None:
    """Refuse fp8 where the device has no fp8 tensor cores, unless emulation was asked for."""
    if fp8.emulate:
        return
    fix = "use amp.Fp8(..., emulate=True) to check numerics (slow), or run on a Hopper/Ada GPU (H100, H200, L40S)"
    if device.type != "cuda":
        raise UsageError(
            f"fp8 training needs a CUDA GPU of compute capability 8.9+, but the device is {device.type}; {fix}")
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise UsageError(
            f"fp8 training needs compute capability 8.9+, but {name} ({device}) has {cc[0]}.{cc[1]}; {fix}")


def _parse_cast_type(value: torch.dtype | str | None, what: str = "cast_model_type") -> torch.dtype | None:
    """A half dtype or float32 (a model cast, or model outputs, may be either)."""
    if value in (torch.float32, "float32", "fp32", "torch.float32"):
        return torch.float32
    return parse_dtype(value, what)


def _check_dtype_on_device(dtype: torch.dtype, device: torch.device, name: str = "dtype") -> None:
    if device.type == "cpu" and dtype is torch.float16:
        raise UsageError(
            f"{name}=float16 was asked for on the CPU, where fp16 math is emulated and slow; "
            f"use {name}=torch.bfloat16 on CPU (or run on a CUDA GPU)"
        )
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise UsageError(f"dtype=bfloat16 needs compute capability 8.0+, but {name} lacks it; use torch.float16")
