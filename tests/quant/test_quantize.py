"""quantize / calibrate / QAT on layers and on the digits CNN, against float references."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
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
    with pytest.warns(RuntimeWarning, match="2.input_quantizer: every input it saw was zero"):
        q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(16, 4)))
    assert float(q[2].input_quantizer.amax) == 0.0
    out = q(torch.randn(4, 4))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, model[2].bias.expand(4, 2), rtol=0, atol=1e-6)
    assert quant.summary(q)["all_zero_inputs"] == ["2"]


def test_forward_loop_that_misses_layers() -> None:
    with pytest.raises(UsageError, match="never reached"):
        quant.quantize(nn.Sequential(nn.Linear(4, 2)), quant.INT8_DEFAULT, forward_loop=lambda m: None)


def test_quantize_with_nothing_selected_says_why() -> None:
    """A forward_loop on a model where no layer was selected: the skipped layers and why, not "call quantize first"."""
    cfg = quant.INT8_DEFAULT.replace(layer_types=("Linear",))
    with pytest.raises(UsageError, match=r"found no layer to quantize \(0: type Conv1d not in layer_types\)"):
        quant.quantize(nn.Sequential(nn.Conv1d(2, 2, 1)), cfg, forward_loop=lambda m: m(torch.randn(1, 2, 4)))
    with pytest.raises(UsageError, match="found no layer to quantize .no layer of types"):
        quant.quantize(nn.Sequential(nn.ReLU()), quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(2)))


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


@pytest.mark.parametrize("preset", [k for k, v in PRESETS.items() if v.residual_add])  # the presets that trace adds
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


# --- regressions ---------------------------------------------------------------------------------
def _fq(x: torch.Tensor, amax: torch.Tensor, qmin: int = -128) -> torch.Tensor:
    """Reference int8 fake quantization: per tensor (amax ()) or per row (amax (C,)), scale amax / 127."""
    s = amax / 127 if amax.dim() == 0 else (amax / 127).view(-1, *[1] * (x.dim() - 1))
    return torch.clamp(torch.round(x / s), qmin, 127) * s


def _wq(w: torch.Tensor) -> torch.Tensor:
    """INT8_DEFAULT's weight: per output channel, narrow range, max-calibrated."""
    return _fq(w.detach(), w.detach().abs().amax(1), qmin=-127)


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = self.a  # the same module under a second name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_shared_module_is_quantized_under_every_name() -> None:
    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(32, 16)
    w, b = model.a.weight.detach().clone(), model.a.bias.detach().clone()
    q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    assert isinstance(q.a, quant.QuantLinear) and q.b is q.a
    assert quant.summary(q)["skipped"] == {}
    # reference: one input quantizer saw both calls while calibrating (weights fake-quantized, inputs
    # passed through), so its amax is the max over x and the relu output
    h = torch.relu(F.linear(x, _wq(w), b))
    amax = torch.maximum(x.abs().max(), h.abs().max())
    torch.testing.assert_close(q.a.input_quantizer.amax, amax, rtol=0, atol=0)
    ref = F.linear(_fq(torch.relu(F.linear(_fq(x, amax), _wq(w), b)), amax), _wq(w), b)
    torch.testing.assert_close(q(x).detach(), ref, rtol=0, atol=1e-5)
    # shared by two parents: both hold the one quantized layer
    lin = nn.Linear(4, 4)
    nested = quant.quantize(nn.ModuleDict({"p": nn.Sequential(lin), "q": nn.Sequential(lin)}), quant.INT8_DEFAULT)
    assert isinstance(nested.p[0], quant.QuantLinear) and nested.q[0] is nested.p[0]


def _mlp_seeded() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))


def test_disabled_quantizers_are_left_alone_by_calibration() -> None:
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    ref_model = _mlp_seeded()
    w0, b0, w2, b2 = (t.detach() for t in (ref_model[0].weight, ref_model[0].bias, ref_model[2].weight, ref_model[2].bias))
    # weight-only fake quantization: the input quantizers are disabled by the config
    cfg = quant.INT8_DEFAULT.replace(input=QuantizerConfig(enabled=False))
    wo = quant.quantize(_mlp_seeded(), cfg, forward_loop=lambda m: m(x))
    assert wo[0].input_quantizer.amax is None and wo[0].input_quantizer.calibrator is None
    ref = F.linear(torch.relu(F.linear(x, _wq(w0), b0)), _wq(w2), b2)
    torch.testing.assert_close(wo(x).detach(), ref, rtol=0, atol=1e-6)
    # a layer kept in float by partial_quantize, then recalibration on other data
    q = quant.quantize(_mlp_seeded(), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    quant.partial_quantize(q, [{"layer": "0"}], k=1)
    before = q[0].input_quantizer.amax.clone()
    quant.calibrate(q, lambda m: m(2 * x))
    assert torch.equal(q[0].input_quantizer.amax, before)  # disabled: not recalibrated
    h = torch.relu(F.linear(2 * x, w0, b0))  # layer 0 runs in float now
    torch.testing.assert_close(q[2].input_quantizer.amax, h.abs().max(), rtol=0, atol=0)
    quant.load_calib_amax(q, "percentile", 99.0)  # switching method skips the disabled layer too
    assert torch.equal(q[0].input_quantizer.amax, before)


class _Prefix(nn.Module):
    """Shape arithmetic on ints next to a real tensor add (prefix tuning style)."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(1, 4, 16))
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = x.size(1) + self.prefix.size(1)  # int + int
        width = x.shape[2] + 0 * x.shape[1]  # int arithmetic through getattr / getitem
        h = torch.cat([self.prefix.expand(x.size(0), -1, -1), x], dim=1)
        h = h + self.fc(h)  # the one tensor add
        return h.reshape(x.size(0), total * width)


def test_int_adds_stay_plain_adds() -> None:
    torch.manual_seed(0)
    model, x = _Prefix(), torch.randn(2, 5, 16)
    q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    assert [n for n, m in q.named_modules() if isinstance(m, quant.QuantAdd)] == ["residual_add0"]
    # reference: h + fc(h), h quantized as the residual and as fc's input (both calibrated on h)
    h = torch.cat([model.prefix.detach().expand(2, -1, -1), x], dim=1)
    hq = _fq(h, h.abs().max())
    ref = (hq + F.linear(hq, _wq(model.fc.weight), model.fc.bias.detach())).reshape(2, 9 * 16)
    torch.testing.assert_close(q(x).detach(), ref, rtol=0, atol=1e-5)
    assert quant.QuantAdd(quant.INT8_DEFAULT)(3, 4) == 7  # numbers reaching a QuantAdd are added as numbers


@pytest.mark.parametrize("dtype, rtol", [(torch.float16, 2**-10), (torch.bfloat16, 2**-7)])
def test_half_model_fake_quantizes_with_fp32_scale(dtype: torch.dtype, rtol: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    q = quant.quantize(nn.Sequential(nn.Linear(16, 8)), quant.INT8_DEFAULT, forward_loop=lambda m: m(x)).to(dtype)
    lin, xh = q[0], x.to(dtype)
    assert lin.input_quantizer.scale().dtype == torch.float32
    # reference: the formula in fp32 on the half values with the (cast) amax, result cast back
    xq = _fq(xh.float(), lin.input_quantizer.amax.float()).to(dtype)
    wq = _fq(lin.weight.detach().float(), lin.weight_quantizer.amax.float(), qmin=-127).to(dtype)
    with torch.no_grad():
        out = q(xh)
    assert out.dtype == dtype
    torch.testing.assert_close(out, F.linear(xq, wq, lin.bias.detach()), rtol=rtol, atol=rtol)


def test_qat_with_amp_o2_policy() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 8, (64,))
    q = quant.quantize(nn.Sequential(nn.Linear(16, 8)), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    before = {n: qq.amax.clone() for n, qq in quant.quantizers(q)}
    result = quant.qat(q, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], epochs=1, lr=1e-3, policy="O2",
                       device="cpu")
    assert math.isfinite(result.history[-1].loss)
    for n, qq in quant.quantizers(q):  # amax fixed; O2 casts the buffer, so equal up to half rounding
        torch.testing.assert_close(qq.amax.float(), before[n], rtol=2**-8, atol=0)


class _NetWithExtras(nn.Module):
    """A residual block with state its forward does not use: an auxiliary head, a buffer, an int."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.aux_head = nn.Linear(16, 4)
        self.register_buffer("class_weights", torch.tensor([1.0, 2.0, 3.0, 4.0]))
        self.num_classes = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))

    def aux_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.aux_head(self.forward(x)), y, weight=self.class_weights)


def test_traced_module_keeps_unused_state_and_methods() -> None:
    torch.manual_seed(0)
    model, x, y = _NetWithExtras(), torch.randn(8, 16), torch.arange(8) % 4
    float_sd = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = quant.INT8_DEFAULT.replace(exclude=("aux_head",))  # forward never reaches it: nothing to calibrate
    q = quant.quantize(model, cfg, forward_loop=lambda m: m(x))
    assert isinstance(q, _NetWithExtras) and type(q).__name__ == "_NetWithExtras"
    assert isinstance(q.residual_add0, quant.QuantAdd) and q.num_classes == 4
    assert set(float_sd) <= set(q.state_dict())  # aux_head.* and class_weights kept
    # reference: x + fc2(relu(fc1(x))) with x quantized once (fc1's input and the residual share amax)
    w1, b1, w2, b2 = (float_sd[k] for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    h_calib = torch.relu(F.linear(x, w1, b1))  # while calibrating, inputs and weights pass through (float network)
    xq = _fq(x, x.abs().max())
    ref = xq + F.linear(_fq(torch.relu(F.linear(xq, _wq(w1), b1)), h_calib.abs().max()), _wq(w2), b2)
    out = q(x).detach()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    ref_aux = F.cross_entropy(F.linear(ref, float_sd["aux_head.weight"], float_sd["aux_head.bias"]), y,
                              weight=float_sd["class_weights"])
    torch.testing.assert_close(q.aux_loss(x, y).detach(), ref_aux, rtol=0, atol=1e-5)
    # a float checkpoint plus the calibrated amax loads strictly into a freshly quantized model
    fresh = quant.quantize(_NetWithExtras(), cfg)
    fresh.load_state_dict(q.state_dict() | float_sd, strict=True)
    torch.testing.assert_close(fresh(x).detach(), out, rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(q)(x).detach(), out, rtol=0, atol=0)


class _ScaledLinear(nn.Linear):
    """A Linear subclass with its own forward: a class swap to QuantLinear would lose it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_linear_subclass_is_reported_not_swapped() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(_ScaledLinear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 16)
    q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    assert type(q[0]) is _ScaledLinear and isinstance(q[2], quant.QuantLinear)
    reason = quant.summary(q)["skipped"]["0"]
    assert "_ScaledLinear subclasses nn.Linear" in reason and "plain nn.Linear" in reason
    torch.testing.assert_close(q[0](x), 2 * F.linear(x, q[0].weight, q[0].bias), rtol=0, atol=0)  # float, own forward
    excluded = quant.quantize(nn.Sequential(_ScaledLinear(4, 4)), quant.INT8_DEFAULT.replace(exclude=("0",)))
    assert "excluded by pattern '0'" in quant.summary(excluded)["skipped"]["0"]


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(144, 2))


def test_calibration_restores_each_modules_training_flag() -> None:
    """A BatchNorm frozen in eval mode inside a training model stays frozen after quantize / calibrate
    (model.train(was_training) used to switch every submodule back to training mode)."""
    x = torch.randn(4, 3, 8, 8)
    m = _bn_net().train()
    m[1].eval()  # frozen BN (fine-tuning recipe)
    m = quant.quantize(m, quant.INT8_DEFAULT, forward_loop=lambda mm: mm(x))
    assert m.training and m[2].training and not m[1].training
    quant.calibrate(m, lambda mm: mm(x))
    assert m.training and m[2].training and not m[1].training


def test_failed_recalibration_keeps_previous_statistics() -> None:
    """A forward_loop raising midway leaves the quantizers out of calibration mode and their previous
    histograms in place (not half a pass), so load_calib_amax gives what it gave before."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    m = quant.quantize(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), quant.INT8_DEFAULT,
                       forward_loop=lambda mm: mm(x))
    quant.load_calib_amax(m, "percentile", 99.0)
    before = {n: q.amax.clone() for n, q in quant.api.quantizers(m)}

    def bad_loop(mm: nn.Module) -> None:
        mm(x[:2] * 100)  # a first batch, then a failure
        raise RuntimeError("data loader died")

    m.train()
    with pytest.raises(RuntimeError, match="loader died"):
        quant.calibrate(m, bad_loop)
    assert m.training and not any(q.calibrating for _, q in quant.api.quantizers(m))
    quant.load_calib_amax(m, "percentile", 99.0)
    for n, q in quant.api.quantizers(m):
        assert torch.equal(q.amax, before[n]), n


@pytest.mark.parametrize("narrow", [False, True])
def test_int8_ste_gradient_is_zero_just_beyond_amax(narrow: bool) -> None:
    """pytorch-quantization's STE: gradient 1 where |x| <= amax, 0 elsewhere. torch's fake_quantize
    backward alone passes it up to 127.5 * scale (and -128.5 * scale), up to 1.2% beyond amax."""
    q = TensorQuantizer(QuantizerConfig(narrow_range=narrow))
    q.set_amax(torch.tensor(1.0))
    x = torch.linspace(-1.02, 1.02, 2001, requires_grad=True)
    q(x).sum().backward()
    assert torch.equal(x.grad, (x.detach().abs() <= 1.0).float())
    w = TensorQuantizer(QuantizerConfig(per_channel=True, narrow_range=True), axis=1)
    w.set_amax(torch.tensor([1.0, 2.0]))
    v = torch.linspace(-2.05, 2.05, 401).view(-1, 1).repeat(1, 2).requires_grad_()
    w(v).sum().backward()
    assert torch.equal(v.grad, (v.detach().abs() <= torch.tensor([1.0, 2.0])).float())


def test_include_exclude_apply_to_graph_quantizers() -> None:
    """exclude=('block.*',) keeps the whole block float, its residual add and attention matmul too;
    include=('head',) quantizes the head only. Names of the remaining ones do not shift."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x + self.proj(x)
            return (y @ y.transpose(-2, -1)) @ x + x  # (B, T, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.other, self.head = Block(), Block(), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.other(self.block(x)))

    x = torch.randn(2, 3, 4)
    cfg = quant.INT8_ATTENTION
    m = quant.quantize(Net(), cfg.replace(exclude=("block.*",)), forward_loop=lambda mm: mm(x))
    assert quant.quantized_layers(m) == ["other.proj", "other.residual_add0", "other.residual_add1", "other.matmul0",
                                         "other.matmul1", "head"]
    assert quant.quantized_layers(quant.quantize(Net(), cfg.replace(include=("head",)), lambda mm: mm(x))) == ["head"]
    m = quant.quantize(Net(), cfg.replace(exclude=("*.residual_add0",)), lambda mm: mm(x))
    assert [n for n in quant.quantized_layers(m) if "add" in n] == ["block.residual_add1", "other.residual_add1"]
