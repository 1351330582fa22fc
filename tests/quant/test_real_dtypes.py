"""Real int8/fp8 modules under dtype casts, and layers whose input and weight formats differ (quant.to_real).

Reference: the fake-quant model (quant.quantize's output) on the same inputs, which the converted model must match to
int8 rounding; after ``.half()`` the converted model must keep that accuracy (its scales and 8-bit weights keep their
dtypes)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from overdrive import quant
from overdrive.quant import QuantConfig, QuantizerConfig


def _calibrated(cfg: QuantConfig, scale: float = 1.0) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    for p in m.parameters():
        p.data *= scale
    xs = [torch.randn(8, 64) for _ in range(4)]
    return quant.quantize(m, cfg, forward_loop=lambda mm: [mm(x) for x in xs], fidelity=False), xs


def test_half_after_to_real_keeps_the_scales_in_fp32() -> None:
    # small weights make x_scale * w_scale about 1e-8: in fp16 that underflowed and the output was 17% off
    q, xs = _calibrated(quant.INT8_DEFAULT, scale=0.002)
    with torch.no_grad():
        want = q(xs[0])
        real = quant.to_real(copy.deepcopy(q)).half()
        got = real(xs[0].half()).float()
    assert real[0].x_scale.dtype == torch.float32 and real[0].w_scale.dtype == torch.float32
    assert real[0].w_q.dtype == torch.int8
    assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_mixed_input_and_weight_formats_stay_float_with_the_reason() -> None:
    # an int8 input with fp8 weights has no kernel: the layer was converted as int8 (weights re-rounded to int8, 5%
    # of the output range off); it now stays float and says why
    cfg = QuantConfig(input=QuantizerConfig(format="int8"), weight=QuantizerConfig(format="fp8_e4m3", per_channel=True))
    q, xs = _calibrated(cfg)
    real = quant.to_real(copy.deepcopy(q))
    assert "no kernel takes both formats" in real._overdrive_real["0"]
    assert isinstance(real[0], nn.Linear)


def test_modelopt_face_has_utils_as_an_attribute() -> None:
    import overdrive.quant.modelopt as mtq

    model = nn.Sequential(nn.Linear(8, 8))
    assert mtq.utils.is_quantized(model) is False


def test_load_calib_amax_checks_the_method_and_the_percentile() -> None:
    # a fraction percentile clipped nearly every activation (amax 0.0127 against 4.1 at 99.99), and a misspelt
    # method ran max, both silently
    import pytest

    from overdrive._utils.errors import UsageError
    from overdrive.quant.pytorch_quantization import nn as quant_nn
    from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

    q = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    q.enable_calib()
    q.disable_quant()
    q(torch.randn(10000, generator=torch.Generator().manual_seed(0)))
    q.disable_calib()
    with pytest.raises(UsageError, match=r"percentile 0.9999 must be a number in \(50, 100\]"):
        q.load_calib_amax("percentile", percentile=0.9999)
    with pytest.raises(UsageError, match="load_calib_amax method 'entropi' is not one of max, percentile"):
        q.load_calib_amax("entropi")
    q.load_calib_amax("percentile", percentile=99.99)
    assert 3.0 < float(q.amax) < 5.0


def test_a_per_channel_amax_of_the_wrong_size_names_the_quantizer() -> None:
    import pytest

    from overdrive._utils.errors import UsageError
    from overdrive.quant.quantizer import TensorQuantizer

    q = TensorQuantizer(QuantizerConfig(per_channel=True), axis=0)
    q.amax = torch.ones(5)
    with pytest.raises(UsageError, match=r"5 per-channel amax values along axis 0, but its input has shape \(4, 3\)"):
        q(torch.randn(4, 3))


def test_export_of_a_bf16_model_is_refused_with_the_fix(tmp_path) -> None:
    # after qat(..., policy="O2") the model is bf16: the export wrote a graph ONNX Runtime refused to load
    import pytest

    pytest.importorskip("onnx")
    from overdrive._utils.errors import UsageError

    q, xs = _calibrated(quant.INT8_DEFAULT)
    with pytest.raises(UsageError, match=r"bfloat16 tensors .* export an fp32 copy"):
        quant.export_onnx(copy.deepcopy(q).bfloat16(), (xs[0].bfloat16(),), tmp_path / "m.onnx")
