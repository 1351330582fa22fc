"""ModelOpt's preset configs for ``overdrive.quant.modelopt`` (``mtq.INT8_DEFAULT_CFG``, ...), read-only, and the
preset and function names this port does not provide, each with what to use instead.

Example:
    >>> from overdrive.quant.modelopt.config import INT8_DEFAULT_CFG
    >>> INT8_DEFAULT_CFG["algorithm"]
    'max'
"""

from __future__ import annotations

import copy
from typing import Any

from overdrive._utils.errors import UsageError


class _ReadOnlyDict(dict):
    """A preset dict that refuses edits, so one script cannot change the preset for every later user in the
    process; ``copy.deepcopy`` (what ModelOpt's docs do before editing) gives plain, editable dicts."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError("mtq's preset configs are read-only; edit a copy: cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG); "
                         'cfg["quant_cfg"]["*lm_head*"] = {"enable": False}')

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


def _read_only(d: Any) -> Any:
    return _ReadOnlyDict({k: _read_only(v) for k, v in d.items()}) if isinstance(d, dict) else d


# ModelOpt's list of layers its presets keep in float (routers, output heads, norms)
_DEFAULT_DISABLED = {
    "nn.BatchNorm1d": {"*": {"enable": False}},
    "nn.BatchNorm2d": {"*": {"enable": False}},
    "nn.BatchNorm3d": {"*": {"enable": False}},
    "nn.LeakyReLU": {"*": {"enable": False}},
    "*lm_head*": {"enable": False},
    "*proj_out.*": {"enable": False},
    "*block_sparse_moe.gate*": {"enable": False},
    "*router*": {"enable": False},
    "*mlp.gate.*": {"enable": False},
    "*mlp.shared_expert_gate.*": {"enable": False},
    "*output_layer*": {"enable": False},
    "output.*": {"enable": False},
    "default": {"enable": False},
}

INT8_DEFAULT_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8, "axis": None},
                  **_DEFAULT_DISABLED},
    "algorithm": "max",
})
"""int8 per-channel weights, per-tensor activations, max calibration (quant.INT8_DEFAULT's numerics)."""

FP8_DEFAULT_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3), "axis": None},
                  "*input_quantizer": {"num_bits": (4, 3), "axis": None}, **_DEFAULT_DISABLED},
    "algorithm": "max",
})
"""fp8 e4m3 per-tensor weights and activations (as ModelOpt; quant.FP8_DEFAULT has per-channel weights)."""

INT8_SMOOTHQUANT_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8, "axis": None},
                  **_DEFAULT_DISABLED},
    "algorithm": "smoothquant",
})
"""SmoothQuant (alpha 0.5; ``{"method": "smoothquant", "alpha": a}`` sets it) then max calibration: int8 per-channel
weights, per-tensor activations (quant.INT8_SMOOTHQUANT's numerics with [-128, 127] weights)."""

INT8_WEIGHT_ONLY_CFG = _read_only({
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"enable": False},
                  **_DEFAULT_DISABLED},
    "algorithm": "max",
})
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
