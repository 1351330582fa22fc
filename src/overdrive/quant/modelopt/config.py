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
"""SmoothQuant (alpha 0.5; ``{"method": "smoothquant", "alpha": a}`` sets it) then max calibration: int8 per-channel
weights, per-tensor activations (quant.INT8_SMOOTHQUANT's numerics with [-128, 127] weights)."""

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
