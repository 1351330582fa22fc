"""quantize / calibrate / QAT on layers and on the digits CNN, against float references."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError
from overdrive.quant import PRESETS, QuantizerConfig, TensorQuantizer


def _calibrated(cfg: QuantizerConfig, x: torch.Tensor, axis: int | None = None) -> TensorQuantizer:
    q = TensorQuantizer(cfg, axis=axis)
    q.start_calibration()
    q(x)
    q.finish_calibration()
    return q


def test_int8_fake_quant_matches_formula() -> None:
    x = torch.randn(1000)
    q = _calibrated(QuantizerConfig(), x)
    s = x.abs().max() / 127
    ref = torch.clamp(torch.round(x / s), -128, 127) * s
    torch.testing.assert_close(q(x), ref, rtol=0, atol=1e-6)


def test_int8_per_channel_narrow_range() -> None:
    w = torch.randn(8, 16) * torch.arange(1, 9).view(8, 1)
    q = _calibrated(QuantizerConfig(per_channel=True, narrow_range=True), w, axis=0)
    s = (w.abs().amax(1) / 127).view(8, 1)
    torch.testing.assert_close(q(w), torch.clamp(torch.round(w / s), -127, 127) * s, rtol=0, atol=1e-6)
    assert q.amax.shape == (8,)


def test_fp8_fake_quant_matches_cast() -> None:
    x = torch.randn(1000) * 3
    q = _calibrated(QuantizerConfig(format="fp8_e4m3"), x)
    s = x.abs().max() / 448
    torch.testing.assert_close(q(x), (x / s).to(torch.float8_e4m3fn).float() * s, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_ste_gradient_clips_outside_amax(fmt: str) -> None:
    q = TensorQuantizer(QuantizerConfig(format=fmt))
    q.set_amax(torch.tensor(1.0))
    x = torch.tensor([0.5, -0.9, 2.0, -3.0], requires_grad=True)
    q(x).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_uncalibrated_run_raises() -> None:
    m = quant.quantize(nn.Linear(4, 2), quant.INT8_DEFAULT)
    with pytest.raises(UsageError, match="not calibrated"):
        m(torch.randn(3, 4))


def test_nan_in_calibration_data_names_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    with pytest.raises(UsageError, match=r"0\.input_quantizer.*NaN/inf"):
        quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(x))


def test_all_zero_activations_no_division_by_zero() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # ReLU output is all zero: fc2's input amax is 0
    q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(16, 4)))
    assert float(q[2].input_quantizer.amax) == 0.0
    out = q(torch.randn(4, 4))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, model[2].bias.expand(4, 2), rtol=0, atol=1e-6)
    assert quant.summary(q)["all_zero_inputs"] == ["2"]


def test_forward_loop_that_misses_layers() -> None:
    with pytest.raises(UsageError, match="never reached"):
        quant.quantize(nn.Sequential(nn.Linear(4, 2)), quant.INT8_DEFAULT, forward_loop=lambda m: None)


def test_quantize_twice_and_bad_config() -> None:
    m = quant.quantize(nn.Sequential(nn.Linear(4, 2)), quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(4, 4)))
    with pytest.raises(UsageError, match="already has quantizers"):
        quant.quantize(m, quant.INT8_DEFAULT)
    with pytest.raises(UsageError, match="QuantConfig"):
        quant.quantize(nn.Linear(2, 2), "int8")  # type: ignore[arg-type]


def test_layer_selection_by_type_and_pattern() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Conv1d(4, 4, 1), nn.ConvTranspose2d(4, 4, 2), nn.Linear(4, 2))
    cfg = quant.INT8_DEFAULT.replace(exclude=("3",), layer_types=("Conv2d", "ConvTranspose2d", "Linear"))
    q = quant.quantize(model, cfg)
    assert [type(m).__name__ for m in q] == ["QuantConv2d", "Conv1d", "QuantConvTranspose2d", "Linear"]
    s = quant.summary(q)["skipped"]
    assert "layer_types" in s["1"] and "'3'" in s["3"]
    assert q[2].weight_quantizer.axis == 1  # ConvTranspose weights are (C_in, C_out, kH, kW)


def test_residual_adds_get_quantizers(trained_cnn) -> None:
    q = quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT)
    adds = [n for n, m in q.named_modules() if isinstance(m, quant.QuantAdd)]
    assert adds == ["block1.residual_add0", "block2.residual_add0"]
    assert q.block1.residual_add0.residual_first  # x + conv2(...): x is the residual
    off = quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT.replace(residual_add=False))
    assert not any(isinstance(m, quant.QuantAdd) for m in off.modules())


@pytest.mark.parametrize("preset", list(PRESETS))
def test_ptq_accuracy_on_digits(trained_cnn, digits, accuracy, preset: str) -> None:
    """Every preset keeps the trained CNN within 2 points of fp32; sensitivity and partial work."""
    base = accuracy(trained_cnn, digits)
    calib = digits.calibration_batches(n=4)
    q = quant.quantize(copy.deepcopy(trained_cnn), PRESETS[preset], forward_loop=lambda m: [m(x) for x in calib])
    assert accuracy(q, digits) >= base - 0.02
    with torch.no_grad():  # fake-quant output is close to fp32: SQNR above 20 dB
        ref, out = trained_cnn(digits.x_test), q(digits.x_test)
    sqnr = 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean())
    assert sqnr > 20, float(sqnr)


def test_compare_calibrators_sensitivity_partial(trained_cnn, digits, accuracy) -> None:
    calib = digits.calibration_batches(n=4)
    q = quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT, forward_loop=lambda m: [m(x) for x in calib])
    rows = quant.compare_calibrators(q, lambda m: accuracy(m, digits))
    assert [r["label"] for r in rows] == ["max", "percentile 99.9", "percentile 99.99", "percentile 99.999", "entropy", "mse"]
    best = max(rows, key=lambda r: r["metric"])
    assert best["best"] and accuracy(q, digits) == pytest.approx(best["metric"])  # the best one is applied
    ranking = quant.sensitivity(q, lambda m: accuracy(m, digits))
    assert {r["layer"] for r in ranking} == set(quant.quantized_layers(q)) and len(ranking) == 10
    kept = quant.partial_quantize(q, ranking, k=2)
    assert kept == [r["layer"] for r in ranking[:2]]
    assert not q.get_submodule(kept[0]).get_submodule(
        "residual_quantizer" if "residual" in kept[0] else "input_quantizer").enabled


def test_qat_keeps_amax_and_accuracy(trained_cnn, digits, accuracy) -> None:
    calib = digits.calibration_batches(n=4)
    q = quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT, forward_loop=lambda m: [m(x) for x in calib])
    before = {n: qq.amax.clone() for n, qq in quant.quantizers(q)}
    ptq = accuracy(q, digits)
    train, test = digits.loaders(batch_size=64)
    train = [b for _, b in zip(range(8), train)]  # a short fine-tune keeps the test fast
    result = quant.qat(q, train, epochs=1, lr=3e-5, eval_data=test)
    assert all(torch.equal(before[n], qq.amax) for n, qq in quant.quantizers(q))
    assert result.history[-1].eval_accuracy >= ptq - 0.01
    with pytest.raises(UsageError, match="lr"):
        quant.qat(q, train, epochs=1, lr=0.0)


def test_calibrated_state_dict_round_trip(trained_cnn, digits) -> None:
    calib = digits.calibration_batches(n=2)
    q = quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT, forward_loop=lambda m: [m(x) for x in calib])
    fresh = quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT)
    fresh.load_state_dict(q.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fresh(digits.x_test), q(digits.x_test), rtol=0, atol=0)


class _Embeddings(nn.Module):
    """token + position embeddings with an optional ``position_ids`` (like BERT's embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(50, 16), nn.Embedding(8, 16)
        self.register_buffer("position_ids", torch.arange(8))

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = self.position_ids[: ids.shape[1]]
        return self.tok(ids) + self.pos(position_ids)


class _TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = _Embeddings(), nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return h + self.fc(h)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_optional_none_arguments_are_not_traced(preset: str) -> None:
    # fx would trace `if position_ids is None` as "not None" and the graph then calls embedding(None)
    torch.manual_seed(0)
    model = _TokenModel().eval()
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    ref = model(ids).detach()
    q = quant.quantize(copy.deepcopy(model), PRESETS[preset], forward_loop=lambda m: m(ids))
    assert quant.summary(q)["untraced"] == ["emb"]  # its add stays in float, reported
    assert isinstance(q.residual_add0, quant.QuantAdd)  # the root's own add is still traced
    out = q(ids).detach()
    tol = 0.05 if preset == "int8" else 0.15  # int8: scale/2 per operand; fp8 e4m3: 2^-4 relative
    assert (out - ref).abs().max() <= tol * ref.abs().max()
    if preset == "int8":  # the real int8 module runs the same graph on CPU
        real = quant.to_real(q)
        torch.testing.assert_close(real(ids).detach(), out, rtol=0, atol=2e-2 * float(ref.abs().max()))
