"""Dynamic per-token activation scales (QuantizerConfig.dynamic, INT8_DYNAMIC): numerics against a hand-written
per-row reference, fidelity on outlier tokens against static per-tensor int8, real kernels, config checks."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError
from overdrive.quant import QuantConfig, QuantizerConfig


def _ref_rows(x: torch.Tensor, bound: float = 127.0, qmin: float = -128.0) -> torch.Tensor:
    """Reference: every row (last dim) quantize-dequantized with its own scale amax(|row|) / bound."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / bound
    return torch.clamp(torch.round(x / scale), qmin, bound) * scale


def _outlier_batch(n: int = 64, k: int = 64, seed: int = 0) -> torch.Tensor:
    """Token activations of a transformer's kind: most rows small, a few tokens 100x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    x[::16] *= 100.0
    return x


def test_dynamic_quantizer_matches_per_row_reference() -> None:
    """Every row gets its own scale: exact against the reference (fp32, atol 0)."""
    q = quant.TensorQuantizer(QuantizerConfig(dynamic=True))
    x = _outlier_batch().reshape(4, 16, 64)  # (batch, tokens, features): rows over the last dim
    torch.testing.assert_close(q(x), _ref_rows(x), rtol=0, atol=0)
    assert q.is_calibrated and q.amax is None and "dynamic per-token" in q.extra_repr()


def test_dynamic_fp8_matches_e4m3_round_trip() -> None:
    q = quant.TensorQuantizer(QuantizerConfig(format="fp8_e4m3", dynamic=True))
    x = _outlier_batch()
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    ref = (x / scale).to(torch.float8_e4m3fn).float() * scale
    torch.testing.assert_close(q(x), ref, rtol=0, atol=0)


def test_dynamic_gradient_is_straight_through() -> None:
    q = quant.TensorQuantizer(QuantizerConfig(dynamic=True))
    x = _outlier_batch().requires_grad_(True)
    g = torch.randn_like(x)
    q(x).backward(g)
    torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


def test_int8_dynamic_needs_no_calibration_and_beats_static_on_outlier_tokens() -> None:
    """INT8_DYNAMIC without forward_loop runs at once; on outlier tokens it keeps the small rows that a per-tensor
    scale (set by the outliers) rounds to zero: output error against fp32 at least 10x lower than INT8_DEFAULT."""
    torch.manual_seed(0)
    float_model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    x = _outlier_batch()
    with torch.no_grad():
        ref = float_model(x)
        dyn = quant.quantize(copy.deepcopy(float_model), quant.INT8_DYNAMIC)
        static = quant.quantize(copy.deepcopy(float_model), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
        small = torch.ones(len(x), dtype=torch.bool)
        small[::16] = False
        err_dyn = (dyn(x) - ref)[small].abs().mean()
        err_static = (static(x) - ref)[small].abs().mean()
    assert err_dyn * 10 < err_static, (float(err_dyn), float(err_static))
    cos = torch.nn.functional.cosine_similarity(dyn(x).detach(), ref, dim=-1)
    assert float(cos.min()) > 0.999


def test_calibrate_does_not_run_forward_loop_when_every_input_is_dynamic() -> None:
    calls = []
    model = quant.quantize(nn.Sequential(nn.Linear(16, 16)), quant.INT8_DYNAMIC,
                           forward_loop=lambda m: calls.append(1), fidelity=False)  # (the fidelity pass would run it)
    assert calls == []
    assert quant.summary(model)["layers"][0].dynamic


def test_to_real_dynamic_matches_fake_quant_cpu() -> None:
    """int8 per-row GEMM (torch._int_mm) = the fake-quant float GEMM up to fp32 rounding (atol 1e-4)."""
    torch.manual_seed(0)
    model = quant.quantize(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)), quant.INT8_DYNAMIC)
    x = _outlier_batch()
    with torch.no_grad():
        ref = model(x)
        real = quant.to_real(copy.deepcopy(model))
        out = real(x)
    assert isinstance(real[0], quant.Int8Linear)
    assert "dynamic" in real._overdrive_real["0"]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_export_onnx_refuses_dynamic_quantizers(tmp_path) -> None:
    model = quant.quantize(nn.Sequential(nn.Linear(8, 8)), quant.INT8_DYNAMIC)
    with pytest.raises(UsageError, match="dynamic per-token"):
        quant.export_onnx(model, torch.randn(2, 8), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("make, match", [
    (lambda: QuantizerConfig(per_channel=True, dynamic=True), "drop per_channel"),
    (lambda: QuantConfig(weight=QuantizerConfig(dynamic=True)), "weights are constants"),
    (lambda: QuantConfig(input=QuantizerConfig(dynamic=True)), "layer_types"),  # the default includes convolutions
])
def test_dynamic_config_errors_name_the_fix(make, match) -> None:
    with pytest.raises(UsageError, match=match):
        make()


def test_dynamic_flag_must_be_a_bool() -> None:
    with pytest.raises(UsageError, match="dynamic='yes'"):
        QuantizerConfig(dynamic="yes")


def test_int8_dynamic_json_round_trip_and_static_json_unchanged() -> None:
    back = QuantConfig.from_json(quant.INT8_DYNAMIC.to_json())
    assert back == quant.INT8_DYNAMIC and back.input.dynamic
    assert "dynamic" not in json.loads(quant.INT8_DEFAULT.to_json())["input"]  # older files read the same
    assert quant.get_preset("int8_dynamic") is quant.INT8_DYNAMIC
