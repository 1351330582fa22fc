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


class _QuantMatMul(torch.nn.Module):
    """A hand-placed pair of quantizers around ``a @ b`` built with ModelOpt's constructor (what export scripts
    write for attention's matmuls, which mtq.quantize leaves alone)."""

    def __init__(self) -> None:
        super().__init__()
        from overdrive.quant.modelopt.config import QuantizerAttributeConfig

        self.input1_quantizer = mtq.nn.TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)))
        self.input2_quantizer = mtq.nn.TensorQuantizer(quant_attribute_cfg={"num_bits": 8, "axis": None},
                                                       if_quant=False, if_calib=True)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.input1_quantizer(a) @ self.input2_quantizer(b)


def test_modelopt_constructor_takes_attribute_config_amax_and_mode_flags() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 8, generator=g), torch.randn(8, 3, generator=g)
    mm = _QuantMatMul()
    q1, q2 = mm.input1_quantizer, mm.input2_quantizer
    assert q1.num_bits == (4, 3) and q1.axis is None and q2.num_bits == 8 and q2._if_calib and not q2._if_quant
    assert isinstance(q1, mtq.nn.TensorQuantizer) and isinstance(q1, mtq.TensorQuantizer)
    q1.enable_calib(); q1.disable_quant()
    assert torch.equal(mm(a, b), a @ b)  # observing: both pass through
    for q in (q1, q2):
        q.load_calib_amax(); q.disable_calib(); q.enable_quant()
    ref1 = mtq.nn.TensorQuantizer(QuantizerConfig(format="fp8_e4m3")); ref1.amax = a.abs().max()
    ref2 = mtq.nn.TensorQuantizer(QuantizerConfig()); ref2.amax = b.abs().max()
    assert torch.equal(q1.amax, a.abs().max()) and torch.equal(q2.amax, b.abs().max())
    assert torch.equal(mm(a, b), ref1(a) @ ref2(b)) and not torch.equal(mm(a, b), a @ b)
    fixed = mtq.nn.TensorQuantizer(amax=2.0)  # scale 2/127: 1.0 -> 64 steps, 3.0 clipped to 2.0
    assert torch.allclose(fixed(torch.tensor([1.0, 3.0])), torch.tensor([64 * 2 / 127, 2.0]), rtol=0, atol=1e-6)
    # every quantizer mtq.quantize placed is an mtq.nn.TensorQuantizer too
    model, x = _model_and_data()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    assert all(isinstance(q, mtq.nn.TensorQuantizer) for q in (model[0].input_quantizer, model[2].weight_quantizer))
    with pytest.raises(TypeError):
        mtq.nn.TensorQuantizer(None, if_quant=True, if_calibrate=True)  # a misspelt argument is not swallowed


def test_set_from_attribute_config_changes_only_the_given_attributes() -> None:
    model, x = _model_and_data()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    wq, iq = model[0].weight_quantizer, model[0].input_quantizer
    amax = iq.amax.clone()
    iq.set_from_attribute_config({"enable": False})  # on / off only: amax kept
    assert not iq.enabled and torch.equal(iq.amax, amax)
    iq.set_from_attribute_config({"enable": True})
    assert torch.equal(iq.amax, amax)
    wq.set_from_attribute_config({"num_bits": (4, 3), "axis": None})  # per-tensor fp8 weights: recalibrated below
    assert wq.num_bits == (4, 3) and wq.axis is None and wq.amax is None and wq.enabled
    mtq.calibrate(model, "max", lambda m: m(x))
    w = model[0].weight.detach()
    assert torch.equal(wq.amax, w.abs().max())
    ref = mtq.nn.TensorQuantizer(QuantizerConfig(format="fp8_e4m3")); ref.amax = w.abs().max()
    assert torch.equal(wq(w), ref(w))
    with pytest.raises(UsageError, match="block_sizes"):
        wq.set_from_attribute_config({"num_bits": 4, "block_sizes": {-1: 128}})
    with pytest.raises(UsageError, match="dict of quantizer attributes"):
        wq.set_from_attribute_config(8)
