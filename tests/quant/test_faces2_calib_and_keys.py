"""ModelOpt's histogram calibrator and algorithm configs, pytorch-quantization's use_fb_fake_quant, and
nn.MultiheadAttention's explanation."""

import copy

import pytest
import torch

import overdrive.quant as quant
import overdrive.quant.modelopt as mtq
from overdrive._utils.errors import UsageError
from overdrive.quant.calibrators import HistogramCalibrator
from overdrive.quant.pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=g)
    x[0, 0] = 40.0  # one outlier: entropy / percentile clip it, max does not
    return x


def _hist_cfg() -> dict:
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None,
                                                                            "calibrator": "histogram"}})
    return cfg


@pytest.mark.parametrize("method,kw", [("entropy", {}), ("mse", {}), ("percentile", {"percentile": 99.9})])
def test_histogram_calibrator_methods_match_the_reference_histogram(method, kw):
    x = _data()
    torch.manual_seed(0)
    model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)), _hist_cfg(), lambda m: m(x))
    q = model[0].input_quantizer
    assert isinstance(q.calibrator, HistogramCalibrator)
    assert float(q.amax) == pytest.approx(40.0)  # algorithm "max": the exact max, histogram kept
    mtq.model_calib.finish_stats_collection(model, method=method, **kw)
    ref = HistogramCalibrator(2048, 127.0)
    ref.collect(x)
    expected = float(ref.compute_amax(method, kw.get("percentile")))
    assert float(q.amax) == pytest.approx(expected, rel=1e-6)
    assert float(q.amax) < 40.0
    assert float(model[0].weight_quantizer.amax.max()) == pytest.approx(float(model[0].weight.detach().abs().max()))


def test_enable_finish_stats_collection_loop():
    x = _data()
    model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)), _hist_cfg())
    mtq.model_calib.enable_stats_collection(model)
    model(x)
    mtq.model_calib.finish_stats_collection(model, method="entropy")
    q = model[0].input_quantizer
    assert q.quant_enabled and not q.calibrating and 0 < float(q.amax) < 40.0


def test_histogram_calibrator_on_weights_and_unknown_methods_refused():
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"].append({"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0,
                                                                             "calibrator": "histogram"}})
    with pytest.raises(UsageError, match="calibrator='histogram'"):
        mtq.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)), cfg)
    with pytest.raises(UsageError, match="finish_stats_collection"):
        mtq.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)), {**_hist_cfg(), "algorithm": "entropy"})
    with pytest.raises(UsageError, match="expected None"):
        mtq.model_calib.finish_stats_collection(torch.nn.Linear(2, 2), method="kl")


def test_algorithm_config_classes_and_context():
    cfg = mtq.config.QuantizeConfig(quant_cfg=mtq.INT8_DEFAULT_CFG["quant_cfg"],
                                    algorithm=mtq.config.SmoothQuantCalibConfig(alpha=0.5))
    assert cfg.model_dump()["algorithm"] == {"method": "smoothquant", "alpha": 0.5}
    with pytest.raises(UsageError, match="alpha"):
        mtq.config.SmoothQuantCalibConfig(alpha=2.0)
    with pytest.raises(UsageError, match="no field"):
        mtq.config.MaxCalibConfig(alpah=1)
    x = _data()
    model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(8, 4)),
                         mtq.config.QuantizeConfig(**mtq.INT8_DEFAULT_CFG), lambda m: m(x))
    q = model[0].weight_quantizer
    amax = q.amax.clone()
    with mtq.set_quantizer_by_cfg_context(model, [{"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}}]):
        assert q.axis is None and q.amax is None  # per tensor inside the block
    assert q.axis == 0 and torch.equal(q.amax, amax)


def test_use_fb_fake_quant_full_range_in_eager():
    q = quant_nn.TensorQuantizer(QuantDescriptor(num_bits=8, narrow_range=True, amax=1.0))
    x = torch.tensor([-1.0, -0.5, 1.0])
    assert float(q(x)[0]) == pytest.approx(-1.0)  # narrow: -127 steps
    try:
        quant_nn.TensorQuantizer.use_fb_fake_quant = True
        out = q(x)
    finally:
        quant_nn.TensorQuantizer.use_fb_fake_quant = False
    ref = torch.fake_quantize_per_tensor_affine(x, 1.0 / 127, 0, -128, 127)
    assert torch.equal(out, ref)
    assert float(q(torch.tensor([-1.01]))) == pytest.approx(-1.0)  # switched back


def test_multihead_attention_explains_why_it_stays_float():
    mha = torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2))
    x = torch.randn(3, 2, 8)
    with pytest.raises(UsageError, match="never calls a Linear"):
        quant.quantize(mha, quant.INT8_DEFAULT, lambda m: m[0](x, x, x))
