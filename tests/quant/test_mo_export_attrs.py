"""ModelOpt-face quantizer attributes read by hand-written export code (maxbound, export_amax, reset_amax,
block_sizes), re-quantizing a quantized model, and mtq.calibrate after the weights changed."""

from __future__ import annotations

import pytest
import torch

import overdrive.quant.modelopt as mtq
from overdrive._utils.errors import UsageError
from overdrive.quant.config import QuantizerConfig


def _model_and_data(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model, torch.randn(32, 16, generator=g)


def test_maxbound_matches_the_formats_largest_value() -> None:
    assert mtq.nn.TensorQuantizer().maxbound == 2 ** (8 - 1) - 1
    narrow = mtq.nn.TensorQuantizer(QuantizerConfig(narrow_range=True))
    assert narrow.maxbound == 2 ** (8 - 1) - 1  # ModelOpt: narrow range does not change maxbound
    fp8 = mtq.nn.TensorQuantizer(QuantizerConfig(format="fp8_e4m3"))
    assert fp8.maxbound == torch.finfo(torch.float8_e4m3fn).max == 448.0


def test_export_amax_gives_trtllm_scales_that_reproduce_the_fake_quant_weight() -> None:
    model, x = _model_and_data()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    fc = model[0]
    wq, iq = fc.weight_quantizer, fc.input_quantizer
    assert wq.block_sizes is None and iq.block_sizes is None and wq.trt_high_precision_dtype == "Float"
    w = fc.weight.detach()
    # per channel: (C,), the max |w| of each output row; per tensor: (1,)
    assert wq.export_amax().shape == (8,) and torch.equal(wq.export_amax(), w.abs().amax(dim=1))
    assert iq.export_amax().shape == (1,) and torch.equal(iq.export_amax(), x.abs().max().reshape(1))
    # what a TensorRT-LLM-style exporter writes: int8 weights and a per-row scale; dequantized = the fake-quant weight
    scale = wq.export_amax() / wq.maxbound
    w_int8 = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    torch.testing.assert_close(w_int8.float() * scale[:, None], wq(w), rtol=0, atol=1e-6)


def test_export_amax_replaces_zero_and_nan_without_touching_the_buffer() -> None:
    q = mtq.nn.TensorQuantizer(QuantizerConfig(per_channel=True), axis=0)
    q.amax = torch.tensor([0.0, 2.0, 3.0])
    assert torch.equal(q.export_amax(), torch.tensor([127.0, 2.0, 3.0]))
    assert torch.equal(q.amax, torch.tensor([0.0, 2.0, 3.0]))
    fp8 = mtq.nn.TensorQuantizer(QuantizerConfig(format="fp8_e4m3"))
    assert fp8.export_amax() is None
    fp8.amax = 0.0
    assert torch.equal(fp8.export_amax(), torch.tensor([448.0]))


def test_reset_amax_uncalibrates_and_calibrate_restores() -> None:
    model, x = _model_and_data()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    before = {n: q.amax.clone() for n, q in model.named_modules() if isinstance(q, mtq.nn.TensorQuantizer)}
    for q in model.modules():
        if isinstance(q, mtq.nn.TensorQuantizer):
            q.reset_amax()
            assert q.amax is None and not q.is_calibrated
    assert not any(k.endswith("amax") for k in model.state_dict())
    mtq.calibrate(model, algorithm="max", forward_loop=lambda m: m(x))
    for n, q in model.named_modules():
        if isinstance(q, mtq.nn.TensorQuantizer):
            assert torch.equal(q.amax, before[n]), n


def test_quantize_twice_points_to_mtq_calibrate() -> None:
    model, x = _model_and_data()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with pytest.raises(UsageError, match=r"mtq\.calibrate\(model, algorithm="):
        mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))


@pytest.mark.parametrize("with_data", [True, False])
def test_calibrate_takes_the_weights_as_they_are_now(with_data: bool) -> None:
    # ModelOpt's max calibration observes every enabled quantizer afresh, weights included (fine-tuned weights)
    model, x = _model_and_data()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    act = float(model[0].input_quantizer.amax)
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    mtq.calibrate(model, "max", forward_loop=(lambda m: m(2 * x)) if with_data else None)
    assert torch.equal(model[0].weight_quantizer.amax, model[0].weight.detach().abs().amax(dim=1))
    assert float(model[0].input_quantizer.amax) == (float(2 * x.abs().max()) if with_data else act)
