"""ModelOpt scripts ported by the import line: ``mtq.QuantizerAttributeConfig``, filter-function keys in a deep-copied
preset's ``quant_cfg``, ``mtq.QuantModuleRegistry``, and the SmoothQuant alpha ModelOpt uses by default.

References: ModelOpt's ``SmoothQuantCalibConfig.alpha`` defaults to 1.0 (``model_calib.smoothquant(..., alpha=1.0)``):
the input quantizer's pre_quant_scale is ``max|W[:, j]| ** (1 - alpha) / max|x_j| ** alpha`` = 1 / max|x_j|, checked
against a float64 recomputation from the calibration data (rtol 1e-5). Quantizer settings are compared exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import overdrive.quant.modelopt as mtq  # was: import modelopt.torch.quantization as mtq
from overdrive._utils.errors import UsageError


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


X = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0] * 7 + [30.0])


def _loop(m: nn.Module) -> None:
    m(X)


def test_quantizer_attribute_config_defaults_and_dict_access() -> None:
    cfg = mtq.QuantizerAttributeConfig(num_bits=(4, 3))
    assert cfg.num_bits == (4, 3) and cfg["axis"] is None and cfg.enable is True and cfg.calibrator == "max"
    assert cfg.model_dump() == dict(cfg) and dict(cfg)["trt_high_precision_dtype"] == "Float"
    assert mtq.QuantizerAttributeConfig.model_validate({"num_bits": [4, 3]}) == cfg  # JSON lists read as tuples
    cfg.axis = 0
    assert cfg["axis"] == 0
    assert copy.deepcopy(cfg) == cfg


@pytest.mark.parametrize("kwargs, match", [
    ({"num_bit": 8}, r"no field 'num_bit'; its fields: \['enable', 'num_bits'"),
    ({"num_bits": 0}, r"num_bits=0: expected a positive int"),
    ({"num_bits": (4, 4)}, r"num_bits=\(4, 4\) is not a floating-point format"),
    ({"axis": 0, "block_sizes": {-1: 128}}, "cannot coexist"),
    ({"type": "dyn"}, r"type='dyn': expected one of \('static', 'dynamic'\)"),
    ({"calibrator": "minmax"}, "expected 'max' or 'histogram'"),
])
def test_quantizer_attribute_config_bad_values_teach(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        mtq.QuantizerAttributeConfig(**kwargs)


def test_bad_assignment_is_refused_and_rolled_back() -> None:
    cfg = mtq.QuantizerAttributeConfig(block_sizes={-1: 128})
    with pytest.raises(UsageError, match="cannot coexist"):
        cfg.axis = 0
    assert cfg.axis is None


def test_attribute_configs_quantize_like_the_dicts() -> None:
    """A QuantizerAttributeConfig wherever a dict of attributes goes: an old-style quant_cfg value, a list entry's cfg,
    set_quantizer_attribute. Same quantizers (format, axis, amax) as the plain-dict preset."""
    ref = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, _loop)
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*weight_quantizer"] = mtq.QuantizerAttributeConfig(num_bits=8, axis=0)
    cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "cfg": mtq.QuantizerAttributeConfig(num_bits=8)})
    got = mtq.quantize(_mlp(), cfg, _loop)
    for (n, a), (_, b) in zip(ref.named_modules(), got.named_modules()):
        if n.endswith("quantizer"):
            assert a.extra_repr() == b.extra_repr(), n
            assert torch.equal(a.amax, b.amax), n
    mtq.set_quantizer_attribute(got, "*weight_quantizer", mtq.QuantizerAttributeConfig(num_bits=(4, 3)))
    assert got[0].weight_quantizer.config.format == "fp8_e4m3" and got[0].weight_quantizer.axis is None
    with pytest.raises(UsageError, match="num_bits=4 is not supported"):
        mtq.quantize(_mlp(), {"quant_cfg": {"*weight_quantizer": mtq.QuantizerAttributeConfig(num_bits=4)}}, _loop)


def test_filter_function_keys_on_a_deep_copied_preset() -> None:
    """ModelOpt's dict form maps "wildcards or filter functions" to attributes; before, a function key on the copy
    of a preset raised 'list indices must be integers or slices, not function'."""
    def keep_last_in_float(name: str) -> bool:
        return name.startswith("2.")

    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"][keep_last_in_float] = {"enable": False}
    assert keep_last_in_float in cfg["quant_cfg"] and cfg["quant_cfg"][keep_last_in_float] == {"enable": False}
    m = mtq.quantize(_mlp(), cfg, _loop)
    assert not m[2].weight_quantizer.enabled and not m[2].input_quantizer.enabled
    assert m[0].weight_quantizer.enabled and m[0].input_quantizer.is_calibrated
    cfg["quant_cfg"][keep_last_in_float] = {"enable": True}  # replaces the entry where it stands
    assert sum(e.get("quantizer_name") is keep_last_in_float for e in cfg["quant_cfg"]) == 1
    del cfg["quant_cfg"][keep_last_in_float]
    assert keep_last_in_float not in cfg["quant_cfg"]


def test_quant_module_registry_at_top_level() -> None:
    assert mtq.QuantModuleRegistry is mtq.nn.QuantModuleRegistry and mtq.TensorQuantizer is mtq.nn.TensorQuantizer


@pytest.mark.parametrize("algorithm", ["smoothquant", {"method": "smoothquant"}])
def test_smoothquant_default_alpha_is_modelopts(algorithm: object) -> None:
    """ModelOpt's "smoothquant" runs alpha 1.0: pre_quant_scale of the input quantizer is 1 / max|x_j| (before: the
    paper's 0.5, sqrt(max|W_j| / max|x_j|), so a ported INT8_SMOOTHQUANT_CFG script gave other numerics)."""
    cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    cfg["algorithm"] = algorithm
    m = mtq.quantize(_mlp(), cfg, _loop)
    x_max = X.double().abs().amax(dim=0)
    torch.testing.assert_close(m[0].input_quantizer.pre_quant_scale.double(), 1.0 / x_max, rtol=1e-5, atol=0)
    # the per-tensor input amax after smoothing: max_j max|x_j| / max|x_j| = 1 (ModelOpt's amax of act_amax * scale)
    torch.testing.assert_close(float(m[0].input_quantizer.amax), 1.0, rtol=1e-5, atol=0)
    cfg["algorithm"] = {"method": "smoothquant", "alpha": 0.5}  # an explicit alpha still wins
    half = mtq.quantize(_mlp(), cfg, _loop)
    w_max = _mlp()[0].weight.detach().double().abs().amax(dim=0)
    torch.testing.assert_close(half[0].input_quantizer.pre_quant_scale.double(), (w_max / x_max).sqrt(),
                               rtol=1e-5, atol=0)
