"""ModelOpt's preset configs for ``overdrive.quant.modelopt`` (``mtq.INT8_DEFAULT_CFG``, ...), read-only, and the
preset and function names this port does not provide, each with what to use instead.

The presets are written as current ModelOpt writes them: ``quant_cfg`` is an ordered list of entries, a deny-all
``{"quantizer_name": "*", "enable": False}`` first, then the entries that configure weights and inputs, then the
layers kept in float (:data:`_default_disabled_quantizer_cfg`). ``copy.deepcopy`` of a preset gives an editable
config whose ``quant_cfg`` is a :class:`~overdrive.quant.modelopt.quant_cfg.QuantCfgList`: ``append`` works as in
current ModelOpt, and the old dict-style edits (``cfg["quant_cfg"]["*lm_head*"] = {"enable": False}``,
``cfg["quant_cfg"]["*weight_quantizer"]["axis"] = None``) work as they did when presets were dicts.

Example:
    >>> from overdrive.quant.modelopt.config import INT8_DEFAULT_CFG
    >>> INT8_DEFAULT_CFG["algorithm"], INT8_DEFAULT_CFG["quant_cfg"][1]
    ('max', {'quantizer_name': '*weight_quantizer', 'cfg': {'num_bits': 8, 'axis': 0}})
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from overdrive._utils.errors import UsageError
from overdrive.quant.modelopt.quant_cfg import QuantCfgList, find_quant_cfg_entry_by_path, normalize_quant_cfg_list

_READ_ONLY = ("mtq's preset configs are read-only; edit a copy: cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG); "
              'cfg["quant_cfg"].append({"quantizer_name": "*lm_head*", "enable": False})')


class _ReadOnlyDict(dict):
    """A preset dict that refuses edits, so one script cannot change the preset for every later user in the
    process; ``copy.deepcopy`` (what ModelOpt's docs do before editing) gives plain, editable dicts."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError(_READ_ONLY)

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


class _ReadOnlyQuantCfgList(QuantCfgList):
    """A preset's ``quant_cfg``: reads like a QuantCfgList (by index or old dict key), refuses edits;
    ``copy.deepcopy`` gives an editable QuantCfgList of plain dicts."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError(_READ_ONLY)

    __setitem__ = __delitem__ = append = extend = insert = remove = pop = clear = sort = reverse = update = _refuse  # type: ignore[assignment]
    __iadd__ = __imul__ = _refuse  # type: ignore[assignment]

    def _flat(self, entry: Any) -> Any:  # a read-only copy: reading must not rewrite the entry
        if "quantizer_name" not in entry:
            return next(iter(entry.values()))
        flat = {**(entry.get("cfg") or {}), **({"enable": entry["enable"]} if "enable" in entry else {})}
        return _read_only(flat)

    def copy(self) -> QuantCfgList:
        return QuantCfgList(self)

    def __copy__(self) -> QuantCfgList:
        return QuantCfgList(self)

    def __deepcopy__(self, memo: dict) -> QuantCfgList:
        return QuantCfgList(copy.deepcopy(e, memo) for e in self)


def _read_only(d: Any) -> Any:
    if isinstance(d, dict):
        return _ReadOnlyDict({k: _read_only(v) for k, v in d.items()})
    if isinstance(d, list):
        return _ReadOnlyQuantCfgList(_read_only(v) for v in d)
    return d


def _disabled(name: str, parent_class: str | None = None) -> dict[str, Any]:
    return {"quantizer_name": name, **({"parent_class": parent_class} if parent_class else {}), "enable": False}


_base_disable_all = _read_only([_disabled("*")])
"""ModelOpt's deny-all entry, first in every preset: quantizers no later entry configures stay off."""

# ModelOpt's list of layers its presets keep in float (routers, output heads, vision towers, norms, embeddings)
_default_disabled_quantizer_cfg = _read_only([
    *(_disabled(n) for n in ("*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*linear_attn.in_proj_a*",
                             "*linear_attn.in_proj_b*", "*lm_head*", "*mixer.conv1d*", "*mlp.gate.*",
                             "*mlp.shared_expert_gate.*", "*output_layer*", "*proj_out.*", "*router*", "mtp.*",
                             "output.*", "*embed_vision*", "*vision_tower*", "*visual*", "*vision_model*",
                             "*multi_modal_projector*")),
    *(_disabled("*", c) for c in ("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.LeakyReLU",
                                  "nn.Embedding")),
])
"""Entries every preset ends with: layers ModelOpt keeps in float (append them to a config built by hand)."""

_INT8_PER_CHANNEL = {"num_bits": 8, "axis": 0}
_INT8 = {"num_bits": 8, "axis": None}
_FP8 = {"num_bits": (4, 3), "axis": None}


def _preset(algorithm: str, *entries: dict[str, Any]) -> Any:
    return _read_only({"quant_cfg": [*_base_disable_all, *entries, *_default_disabled_quantizer_cfg],
                       "algorithm": algorithm})


INT8_DEFAULT_CFG = _preset("max", {"quantizer_name": "*weight_quantizer", "cfg": dict(_INT8_PER_CHANNEL)},
                           {"quantizer_name": "*input_quantizer", "cfg": dict(_INT8)})
"""int8 per-channel weights, per-tensor activations, max calibration (quant.INT8_DEFAULT's numerics)."""

FP8_DEFAULT_CFG = _preset("max", {"quantizer_name": "*weight_quantizer", "cfg": dict(_FP8)},
                          {"quantizer_name": "*input_quantizer", "cfg": dict(_FP8)})
"""fp8 e4m3 per-tensor weights and activations (as ModelOpt; quant.FP8_DEFAULT has per-channel weights)."""

INT8_SMOOTHQUANT_CFG = _preset("smoothquant", {"quantizer_name": "*weight_quantizer", "cfg": dict(_INT8_PER_CHANNEL)},
                               {"quantizer_name": "*input_quantizer", "cfg": dict(_INT8)})
"""SmoothQuant then max calibration: int8 per-channel weights, per-tensor activations. ``"smoothquant"`` takes
ModelOpt's default alpha, 1.0 (input channel j divided by its max |x_j|, the weight column multiplied by it);
``{"method": "smoothquant", "alpha": a}`` sets it (0.5 is the paper's, and quant.INT8_SMOOTHQUANT's)."""

INT8_WEIGHT_ONLY_CFG = _preset("max", {"quantizer_name": "*weight_quantizer", "cfg": dict(_INT8_PER_CHANNEL)},
                               {"quantizer_name": "*input_quantizer", "enable": False})
"""int8 per-channel weights, activations left in float (ModelOpt's weight-only int8)."""

# ModelOpt presets this port does not provide, and what to use instead: ``mtq.INT4_AWQ_CFG`` raises this (an
# AttributeError that says so) instead of a bare "module has no attribute"
_WEIGHT_4BIT = ("overdrive.quant has no 4-bit fake quantization for mtq.quantize; for 4-bit weights use "
                "quant.weight_only(model, bits=4, group_size=128) (round-to-nearest per-group scales, no AWQ search)")
_MISSING_PRESETS = {
    **{n: _WEIGHT_4BIT for n in ("INT4_AWQ_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A8_AWQ_BETA_CFG")},
    **{n: "NVFP4 / MX formats need Blackwell-class kernels and block scales, which overdrive.quant does not have; "
          "use mtq.FP8_DEFAULT_CFG (Hopper fp8) or mtq.INT8_DEFAULT_CFG"
       for n in ("NVFP4_DEFAULT_CFG", "NVFP4_AWQ_LITE_CFG", "NVFP4_AWQ_CLIP_CFG", "NVFP4_AWQ_FULL_CFG",
                 "NVFP4_MLP_ONLY_CFG", "NVFP4_MLP_WEIGHT_ONLY_CFG", "W4A8_NVFP4_FP8_CFG", "MXFP8_DEFAULT_CFG",
                 "MXFP6_DEFAULT_CFG", "MXFP4_DEFAULT_CFG", "MXINT8_DEFAULT_CFG", "W4A8_MXFP4_FP8_CFG")},
    **{n: "KV-cache quantization is not in overdrive.quant; quantize the GEMMs with mtq.FP8_DEFAULT_CFG and keep the "
          "KV cache in the model's dtype" for n in ("FP8_KV_CFG", "FP8_AFFINE_KV_CFG", "NVFP4_KV_CFG",
                                                    "NVFP4_AFFINE_KV_CFG", "NVFP4_KV_ROTATE_CFG")},
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": "per-token fp8 activation scales are not in this port; use mtq.FP8_DEFAULT_CFG "
                                     "(per-tensor) or quant.dynamic_int8(model) for per-token int8",
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": "block-wise fp8 weights are not in this port; use mtq.FP8_DEFAULT_CFG",
}


_FP_FORMATS = ((4, 3), (5, 2), (2, 1), (1, 2), (0, 3), (3, 0), (3, 2), (2, 3))  # the (E, M) pairs ModelOpt accepts
_ATTRIBUTE_DEFAULTS = MappingProxyType({
    "enable": True, "num_bits": 8, "axis": None, "fake_quant": True, "unsigned": False, "narrow_range": False,
    "learn_amax": False, "type": "static", "block_sizes": None, "bias": None, "trt_high_precision_dtype": "Float",
    "calibrator": "max", "rotate": False, "pass_through_bwd": True,
})


class QuantizerAttributeConfig(Mapping):
    """ModelOpt's ``mtq.QuantizerAttributeConfig``: one quantizer's attributes, every field with ModelOpt's default
    (``enable=True, num_bits=8, axis=None, fake_quant=True, unsigned=False, narrow_range=False, type="static",
    block_sizes=None, trt_high_precision_dtype="Float", calibrator="max"``, ...). Checked as ModelOpt checks it when
    built or assigned (a field name, ``num_bits`` a positive int or an (E, M) pair, ``type``, ``calibrator``,
    ``axis`` and ``block_sizes`` not both). It reads as a dict (``cfg["num_bits"]``, ``dict(cfg)``,
    ``cfg.model_dump()``), so it goes wherever a dict of attributes goes: a ``quant_cfg`` value or entry ``cfg``,
    ``mtq.set_quantizer_attribute``. Whether overdrive can apply it (int8 / fp8 e4m3, no blocks) is checked there.

    Example:
        >>> import overdrive.quant.modelopt as mtq
        >>> cfg = mtq.QuantizerAttributeConfig(num_bits=(4, 3), axis=None)
        >>> cfg.num_bits, cfg["enable"], cfg.model_dump()["calibrator"]
        ((4, 3), True, 'max')
    """

    def __init__(self, **attributes: Any) -> None:
        for name, value in {**_ATTRIBUTE_DEFAULTS, **attributes}.items():
            setattr(self, name, value)
        self._check()

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _ATTRIBUTE_DEFAULTS:
            raise UsageError(f"QuantizerAttributeConfig has no field {name!r}; its fields: {list(_ATTRIBUTE_DEFAULTS)}")
        if name == "num_bits" and isinstance(value, list):
            value = tuple(value)  # JSON / YAML give (4, 3) as a list
        old = self.__dict__.get(name, _ATTRIBUTE_DEFAULTS[name])
        object.__setattr__(self, name, value)
        if len(self.__dict__) == len(_ATTRIBUTE_DEFAULTS):  # assignment after construction: check it, as pydantic does
            try:
                self._check()
            except UsageError:
                object.__setattr__(self, name, old)
                raise

    def _check(self) -> None:
        bits = self.num_bits
        if isinstance(bits, bool) or not (
                (isinstance(bits, int) and bits > 0)
                or (isinstance(bits, tuple) and len(bits) == 2 and all(isinstance(b, int) for b in bits))):
            raise UsageError(f"QuantizerAttributeConfig num_bits={bits!r}: expected a positive int (8) or an "
                             "(exponent, mantissa) pair such as (4, 3)")
        if isinstance(bits, tuple) and bits not in _FP_FORMATS:
            raise UsageError(f"QuantizerAttributeConfig num_bits={bits!r} is not a floating-point format ModelOpt "
                             f"knows; expected one of {list(_FP_FORMATS)}, e.g. (4, 3) for fp8 e4m3")
        axis = self.axis
        if not (axis is None or (isinstance(axis, int) and not isinstance(axis, bool))
                or (isinstance(axis, tuple) and all(isinstance(a, int) for a in axis))):
            raise UsageError(f"QuantizerAttributeConfig axis={axis!r}: expected None (per tensor), an int (0: per "
                             "output channel of a weight) or a tuple of ints")
        if self.block_sizes is not None and axis is not None:
            raise UsageError(f"QuantizerAttributeConfig axis={axis!r} with block_sizes={self.block_sizes!r}: they "
                             "cannot coexist; set axis=None for block quantization")
        for name in ("enable", "fake_quant", "unsigned", "narrow_range", "learn_amax", "rotate", "pass_through_bwd"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"QuantizerAttributeConfig {name}={getattr(self, name)!r} must be True or False")
        if self.learn_amax:
            raise UsageError("QuantizerAttributeConfig learn_amax=True: deprecated in ModelOpt; leave it False")
        choices = {"type": ("static", "dynamic"), "trt_high_precision_dtype": ("Float", "Half", "BFloat16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise UsageError(f"QuantizerAttributeConfig {name}={getattr(self, name)!r}: expected one of {allowed}")
        if isinstance(self.calibrator, str) and self.calibrator not in ("max", "histogram"):
            raise UsageError(f"QuantizerAttributeConfig calibrator={self.calibrator!r}: expected 'max' or 'histogram'")

    def __getitem__(self, key: str) -> Any:
        if key not in _ATTRIBUTE_DEFAULTS:
            raise KeyError(key)
        return self.__dict__[key]

    def __iter__(self) -> Iterator[str]:
        return iter(_ATTRIBUTE_DEFAULTS)

    def __len__(self) -> int:
        return len(_ATTRIBUTE_DEFAULTS)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def model_dump(self) -> dict[str, Any]:
        """The attributes as a plain dict (pydantic's name, which ModelOpt's configs have)."""
        return {k: copy.deepcopy(self.__dict__[k]) for k in _ATTRIBUTE_DEFAULTS}

    @classmethod
    def model_validate(cls, obj: Mapping[str, Any]) -> QuantizerAttributeConfig:
        """A config from a dict of attributes (pydantic's name)."""
        if not isinstance(obj, Mapping):
            raise UsageError(f"QuantizerAttributeConfig.model_validate takes a dict of attributes; got {obj!r}")
        return cls(**obj)

    def __repr__(self) -> str:
        return f"QuantizerAttributeConfig({', '.join(f'{k}={v!r}' for k, v in self.items())})"


class MissingPresetError(UsageError, AttributeError):
    """A ModelOpt preset name this port does not provide: says what to use instead (an AttributeError too, so
    ``hasattr(mtq, name)`` is False and ``getattr(mtq, name, default)`` works).

    Example:
        >>> import overdrive.quant.modelopt as mtq
        >>> hasattr(mtq, "NVFP4_DEFAULT_CFG"), hasattr(mtq, "INT8_DEFAULT_CFG")
        (False, True)
    """


# ModelOpt functions this port does not provide, and what does the job in overdrive
_MISSING_FUNCTIONS = {
    "export": "to export the quantized model use quant.export_onnx(model, example_inputs, 'model.onnx') (ONNX Q/DQ "
              "for TensorRT) or quant.to_real(model) (real int8 / fp8 modules in PyTorch)",
    "compress": "to store weights in low precision use quant.to_real(model) (int8 / fp8 weights, torch._int_mm / "
                "torch._scaled_mm) or quant.weight_only(model, bits=4, group_size=128)",
    "auto_quantize": "per-layer format search is not in overdrive.quant; quant.sensitivity(model, eval_fn) ranks the "
                     "layers and quant.partial_quantize(model, ranking, k=...) keeps the most sensitive in float",
}


class _AlgorithmConfig(Mapping):
    """ModelOpt's ``QuantizeAlgorithmConfig``: a validated algorithm (``method`` plus its settings) that reads as the
    dict form ``{"method": ..., ...}``, so it goes wherever ``config["algorithm"]`` goes."""

    _method: str | None = None
    _fields: dict[str, Any] = {}

    def __init__(self, **settings: Any) -> None:
        method = settings.pop("method", self._method)
        if method != self._method:
            raise UsageError(f"{type(self).__name__} method={method!r}: it is fixed to {self._method!r}")
        bad = [k for k in settings if k not in self._fields]
        if bad:
            raise UsageError(f"{type(self).__name__} has no field(s) {bad}; its fields: {['method', *self._fields]}")
        values = {**self._fields, **settings}
        self._check(values)
        object.__setattr__(self, "_values", {"method": method, **values})

    def _check(self, values: dict[str, Any]) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def model_dump(self) -> dict[str, Any]:
        """The settings as a plain dict (pydantic's name)."""
        return dict(self._values)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


class MaxCalibConfig(_AlgorithmConfig):
    """ModelOpt's ``mtq.config.MaxCalibConfig``: max calibration (``{"method": "max"}``). ``distributed_sync`` is
    accepted; a single process has nothing to sync.

    Example:
        >>> import torch, overdrive.quant.modelopt as mtq
        >>> cfg = mtq.config.QuantizeConfig(quant_cfg=mtq.INT8_DEFAULT_CFG["quant_cfg"],
        ...                                 algorithm=mtq.config.MaxCalibConfig())
        >>> m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), cfg, lambda m: m(torch.ones(2, 4)))
        >>> float(m[0].input_quantizer.amax)
        1.0
    """

    _method = "max"
    _fields = {"distributed_sync": True}

    def _check(self, values: dict[str, Any]) -> None:
        if values["distributed_sync"] not in (True, False, None):
            raise UsageError(f"MaxCalibConfig distributed_sync={values['distributed_sync']!r} must be True or False")


class SmoothQuantCalibConfig(_AlgorithmConfig):
    """ModelOpt's ``mtq.config.SmoothQuantCalibConfig``: SmoothQuant then max calibration; ``alpha`` in [0, 1]
    (ModelOpt's default 1.0).

    Example:
        >>> from overdrive.quant.modelopt.config import SmoothQuantCalibConfig
        >>> dict(SmoothQuantCalibConfig(alpha=0.5))
        {'method': 'smoothquant', 'alpha': 0.5}
    """

    _method = "smoothquant"
    _fields = {"alpha": 1.0}

    def _check(self, values: dict[str, Any]) -> None:
        from overdrive.quant.config import check_alpha

        values["alpha"] = check_alpha(values["alpha"])


class QuantizeConfig(Mapping):
    """ModelOpt's ``mtq.config.QuantizeConfig``: ``quant_cfg`` (the list of entries or the old dict) and
    ``algorithm`` (``"max"``, ``"smoothquant"``, None, a dict with ``"method"``, or a MaxCalibConfig /
    SmoothQuantCalibConfig). Reads as ``{"quant_cfg": ..., "algorithm": ...}``, so ``mtq.quantize`` takes it;
    ``QuantizeConfig(**mtq.INT8_DEFAULT_CFG)`` builds one from a preset.

    Example:
        >>> import overdrive.quant.modelopt as mtq
        >>> cfg = mtq.config.QuantizeConfig(**mtq.INT8_DEFAULT_CFG)
        >>> cfg.algorithm, cfg["quant_cfg"][1]["quantizer_name"]
        ('max', '*weight_quantizer')
    """

    def __init__(self, quant_cfg: Any = None, algorithm: Any = "max") -> None:
        if quant_cfg is None:
            quant_cfg = [{"quantizer_name": "*", "enable": False}]  # ModelOpt's default: nothing quantized
        if not isinstance(quant_cfg, (list, Mapping)):
            raise UsageError(f"QuantizeConfig quant_cfg={quant_cfg!r} must be a list of entries or a dict of patterns")
        if not (algorithm is None or isinstance(algorithm, (str, Mapping))):
            raise UsageError(f"QuantizeConfig algorithm={algorithm!r} must be a method name ('max'), None, a dict "
                             "with 'method', or an algorithm config such as MaxCalibConfig()")
        normalize_quant_cfg_list(quant_cfg)  # a malformed entry is named now, not at quantize()
        self.quant_cfg = copy.deepcopy(quant_cfg)
        self.algorithm = algorithm

    def __getitem__(self, key: str) -> Any:
        if key not in ("quant_cfg", "algorithm"):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("quant_cfg", "algorithm"))

    def __len__(self) -> int:
        return 2

    def model_dump(self) -> dict[str, Any]:
        """``{"quant_cfg": ..., "algorithm": ...}`` as plain values (pydantic's name)."""
        algorithm = dict(self.algorithm) if isinstance(self.algorithm, _AlgorithmConfig) else self.algorithm
        return {"quant_cfg": copy.deepcopy(self.quant_cfg), "algorithm": algorithm}
