"""ModelOpt's ``modelopt.torch.quantization`` names over overdrive.quant, so a ModelOpt script runs with one line
changed: ``import modelopt.torch.quantization as mtq`` -> ``import overdrive.quant.modelopt as mtq`` (and
``import modelopt.torch.opt as mto`` -> ``import overdrive.quant.modelopt.opt as mto``).

A config's ``quant_cfg`` is taken in both of ModelOpt's forms (:mod:`overdrive.quant.modelopt.quant_cfg`): the
current ordered list of entries (``quantizer_name`` fnmatch pattern on quantizer names such as
``"*weight_quantizer"``, optional ``parent_class`` such as ``"nn.Linear"``, ``cfg`` of attributes, ``enable``;
later entries override earlier ones; a ``cfg`` entry replaces the attributes, an ``enable``-only entry just
switches quantizers on or off), and the older dict of patterns (``"default"`` first, then each key in order).
Attributes: ``num_bits`` 8 or (4, 3) / ``"e4m3"``, ``axis``, ``narrow_range``. ``algorithm`` ``"max"``
calibrates with max; None leaves activations uncalibrated. The presets' ``quant_cfg`` is a list that also takes
the old dict-style edits, so scripts of either generation run on a ``copy.deepcopy`` of one.

Example:
    >>> import copy, torch
    >>> import overdrive.quant.modelopt as mtq
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    >>> cfg["quant_cfg"].append({"quantizer_name": "2*", "enable": False})  # keep the last layer in float
    >>> model = mtq.quantize(model, cfg, forward_loop=lambda m: m(torch.randn(32, 8)))
    >>> model[0].input_quantizer.is_calibrated, model[2].weight_quantizer.enabled
    (True, False)
"""

from __future__ import annotations

from typing import Any

from overdrive.quant.modelopt.config import (_MISSING_FUNCTIONS, _MISSING_PRESETS, FP8_DEFAULT_CFG, INT8_DEFAULT_CFG,
                                             INT8_SMOOTHQUANT_CFG, INT8_WEIGHT_ONLY_CFG, MissingPresetError,
                                             QuantizerAttributeConfig)
from overdrive.quant.modelopt.conversion import (register, set_quantizer_attribute, set_quantizer_by_cfg,
                                                 set_quantizer_by_cfg_context, unregister)
from overdrive.quant.modelopt.model_quant import (ForwardLoop, calibrate, disable_quantizer, enable_quantizer,
                                                  fold_weight, postprocess_amax, print_quant_summary, quantize)
from overdrive.quant.modelopt.quant_cfg import QuantCfgList, find_quant_cfg_entry_by_path, normalize_quant_cfg_list


def __getattr__(name: str) -> Any:
    if name in _MISSING_PRESETS:
        raise MissingPresetError(f"mtq.{name} is not available in overdrive.quant.modelopt: {_MISSING_PRESETS[name]}")
    if name in _MISSING_FUNCTIONS:
        raise MissingPresetError(f"mtq.{name} is not available in overdrive.quant.modelopt: {_MISSING_FUNCTIONS[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "INT8_WEIGHT_ONLY_CFG", "QuantCfgList",
           "QuantizerAttributeConfig", "QuantModuleRegistry", "TensorQuantizer",
           "normalize_quant_cfg_list", "find_quant_cfg_entry_by_path", "quantize", "calibrate",
           "register", "unregister",
           "set_quantizer_by_cfg", "set_quantizer_by_cfg_context", "set_quantizer_attribute", "postprocess_amax", "fold_weight", "disable_quantizer",
           "enable_quantizer", "print_quant_summary", "nn"]

from overdrive.quant.modelopt import nn  # noqa: E402  (mtq.nn.TensorQuantizer; imported last: it needs nothing above)
from overdrive.quant.modelopt import model_calib  # noqa: E402, F401  (mtq.model_calib.finish_stats_collection)
from overdrive.quant.modelopt import utils  # noqa: E402  (mtq.utils.is_quantized, as ModelOpt's package has it)
from overdrive.quant.modelopt.nn import QuantModuleRegistry, TensorQuantizer  # noqa: E402  (mtq.QuantModuleRegistry, as ModelOpt)
