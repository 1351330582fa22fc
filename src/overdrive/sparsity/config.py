"""The one config object of ``overdrive.sparsity``: which pattern, which mask calculator, which layers."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError

PATTERNS = ("2:4",)
MASK_CALCULATORS = ("m4n2_1d", "m4n2_2d_greedy", "m4n2_2d_best")
# apex spells the transposable calculators "m4n2_2d_greedy"/"m4n2_2d_best"; "m4n2_2d" means best.
_ALIASES = {"m4n2_2d": "m4n2_2d_best"}
LAYER_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "MultiheadAttention")


@dataclass(frozen=True)
class SparsityConfig(ConfigBase):
    """How to prune a model to 2:4 structured sparsity.

    Args:
        pattern: the N:M pattern; "2:4" (2 kept of every 4 along the input dimension).
        mask_calculator: "m4n2_1d" (keep the 2 largest |w| of every 4), "m4n2_2d_greedy" or
            "m4n2_2d_best" (transposable: 2 of 4 along rows and columns of each 4x4 block, so the
            transposed weight is 2:4 too, which the backward pass of sparse training can use).
        layer_types: which layer kinds to prune (subclasses included).
        allowed_layer_names: prune only these module names (None: all of ``layer_types``).
        disallowed_layer_names: never prune these module names (e.g. the classifier head).
        permutation: search an input-channel permutation (torch.fx) that raises kept magnitude.
        permutation_budget_s: about how many seconds the permutation search may spend per channel group,
            counted as work (weights scored), not time, so that the result is deterministic.
        allow_recompute_mask: keep the pruned weight values aside (apex ASP) so masks can be recomputed
            later; a recompute puts them back and keeps the trained values of the other weights.
        custom_layers: apex's ``custom_layer_dict``: other layer classes (subclasses included) and the names of
            their parameters to prune, ``{MyLinear: ["weight"]}``; each parameter is read as a GEMM operand
            (out, in, *k), groups of 4 along dim 1. Kept as ``(("module.Class", ("weight",)), ...)`` so the
            config stays JSON.

    Example:
        >>> cfg = SparsityConfig(mask_calculator="m4n2_2d_best", disallowed_layer_names=("head",))
        >>> SparsityConfig.from_json(cfg.to_json()) == cfg
        True
    """

    pattern: str = "2:4"
    mask_calculator: str = "m4n2_1d"
    layer_types: tuple[str, ...] = LAYER_TYPES
    allowed_layer_names: tuple[str, ...] | None = None
    disallowed_layer_names: tuple[str, ...] = field(default_factory=tuple)
    permutation: bool = False
    permutation_budget_s: float = 2.0
    allow_recompute_mask: bool = False
    custom_layers: tuple[tuple[str, tuple[str, ...]], ...] = ()

    _JSON_SORT_KEYS = True  # the form save_compressed has written into checkpoints
    _ADDED_FIELDS = ("custom_layers",)

    def __post_init__(self) -> None:
        for key in ("layer_types", "allowed_layer_names", "disallowed_layer_names"):
            value = getattr(self, key)
            if isinstance(value, str):  # tuple("head") would be ('h', 'e', 'a', 'd'): no layer of that name
                raise UsageError(f"{key}={value!r} is a string; pass a tuple or list of names, e.g. {key}=({value!r},)")
        if self.pattern not in PATTERNS:
            raise UsageError(f"pattern {self.pattern!r} is not supported; use one of {PATTERNS} (sparse tensor cores do 2:4)")
        calc = _ALIASES.get(self.mask_calculator, self.mask_calculator)
        if calc not in MASK_CALCULATORS:
            raise UsageError(f"mask_calculator {self.mask_calculator!r} is not one of {MASK_CALCULATORS}")
        object.__setattr__(self, "mask_calculator", calc)
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise UsageError(f"layer_types {bad} not supported; choose from {LAYER_TYPES}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.allowed_layer_names is not None:
            object.__setattr__(self, "allowed_layer_names", tuple(self.allowed_layer_names))
        object.__setattr__(self, "disallowed_layer_names", tuple(self.disallowed_layer_names))
        object.__setattr__(self, "custom_layers", _custom_layers(self.custom_layers))
        budget = self.permutation_budget_s
        # nan passed a plain `<= 0` check and then switched the search off without a word
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
            raise UsageError(f"permutation_budget_s {budget!r} must be a number of seconds > 0, e.g. 2.0")


def class_key(cls: type) -> str:
    """The name a layer class goes by in ``custom_layers``: ``module.QualName``.

    Example:
        >>> import torch
        >>> class_key(torch.nn.Linear)
        'torch.nn.modules.linear.Linear'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def _custom_layers(value: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``{MyLinear: ["weight"]}`` (or its JSON form, pairs of a class name and names) -> sorted pairs."""
    pairs = value.items() if isinstance(value, dict) else value
    example = "custom_layers={MyLinear: ['weight']}"
    out: dict[str, tuple[str, ...]] = {}
    try:
        pairs = list(pairs)
    except TypeError:
        raise UsageError(f"custom_layers={value!r} is not a dict of layer class -> parameter names; e.g. {example}") from None
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise UsageError(f"custom_layers entry {pair!r} is not (layer class, parameter names); e.g. {example}")
        cls, names = pair
        key = class_key(cls) if isinstance(cls, type) else cls
        if not isinstance(key, str) or not key:
            raise UsageError(f"custom_layers key {cls!r} is not a layer class; e.g. {example}")
        if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
            raise UsageError(f"custom_layers[{key}] = {names!r}: give a list of parameter names, e.g. ['weight']")
        out[key] = tuple(names)
    return tuple(sorted(out.items()))


# Named presets.
ASP_DEFAULT = SparsityConfig()  # apex ASP's default: m4n2_1d on Linear/Conv/MHA
TRANSPOSABLE = SparsityConfig(mask_calculator="m4n2_2d_best")
PERMUTED = SparsityConfig(permutation=True)
PRESETS: dict[str, SparsityConfig] = {"default": ASP_DEFAULT, "transposable": TRANSPOSABLE, "permuted": PERMUTED}


def _deprecated_config(where: str) -> type[SparsityConfig]:
    """``Config``, the class's name before every technique's config was named <Technique>Config."""
    warnings.warn(f"{where} is deprecated; use SparsityConfig (the same class)", DeprecationWarning, stacklevel=3)
    return SparsityConfig


def __getattr__(name: str) -> Any:
    if name == "Config":
        return _deprecated_config("overdrive.sparsity.config.Config")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
