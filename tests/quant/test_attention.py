"""Attention-matmul quantization (``QuantConfig.quantize_matmuls``): QK^T and PV in a hand-written
attention block, SDPA's q/k/v, against hand-applied fake quantization; calibration; ONNX placement
and ONNX Runtime; accuracy of a small attention classifier trained on the digits."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError


class _Attention(nn.Module):
    """Multi-head self-attention written out by hand (nanoGPT style), plus the residual add."""

    def __init__(self, d: int = 32, heads: int = 2, sdpa: bool = False) -> None:
        super().__init__()
        self.d, self.h, self.hs, self.sdpa = d, heads, d // heads, sdpa
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).split(self.d, dim=2)
        shape = (x.size(0), x.size(1), self.h, self.hs)
        return tuple(t.view(shape).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        q, k, v = self.heads(x)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hs))  # (B, nh, T, T)
            y = torch.matmul(att.softmax(-1), v)  # (B, nh, T, hs)
        return x + self.proj(y.transpose(1, 2).reshape(x.size(0), x.size(1), self.d))


class _DigitsAttention(nn.Module):
    """The 8x8 digit as 8 row tokens of 8 pixels: embed, one attention block, mean pool, classify."""

    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.pos = nn.Parameter(torch.zeros(8, 32))
        self.attn = _Attention(32, 2, sdpa)
        self.head = nn.Linear(8 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8)
        h = self.embed(x.flatten(1, 2)) + self.pos  # (B, 8, 32)
        return self.head(self.attn(h).flatten(1))


def _fq(x: torch.Tensor, amax: torch.Tensor | None, fmt: str = "int8") -> torch.Tensor:
    """Per-tensor fake quantization written out (zero point 0): the reference; amax None: float."""
    if amax is None:
        return x
    if fmt == "int8":
        s = amax / 127
        return torch.clamp(torch.round(x / s), -128, 127) * s
    s = amax / 448
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def _reference(block: _Attention, x: torch.Tensor, amax: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """The float block with the matmul operands fake-quantized by hand (amax: QK^T's q, k^T; PV's P, V)."""
    q, k, v = block.heads(x)
    att = (_fq(q, amax[0], fmt) @ _fq(k.transpose(-2, -1), amax[1], fmt)) * (1.0 / math.sqrt(block.hs))
    y = _fq(att.softmax(-1), amax[2], fmt) @ _fq(v, amax[3], fmt)
    return x + block.proj(y.transpose(1, 2).reshape(x.size(0), x.size(1), block.d))


def _only_matmuls(fmt: str) -> quant.QuantConfig:
    base = quant.INT8_DEFAULT if fmt == "int8" else quant.FP8_DEFAULT
    return base.replace(layer_types=(), residual_add=False, quantize_matmuls=True)


@pytest.fixture(scope="module")
def trained_attention(digits, trainer):
    """_DigitsAttention trained briefly in fp32 (96% test accuracy; about 2 s on 2 idle cores)."""
    torch.manual_seed(0)
    return trainer(_DigitsAttention(), digits, lr=1e-2, epochs=6, batch_size=128)


def test_option_off_changes_nothing() -> None:
    torch.manual_seed(0)
    model = _DigitsAttention().eval()
    assert not quant.INT8_DEFAULT.quantize_matmuls and not quant.FP8_DEFAULT.quantize_matmuls
    q = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT)
    assert not any(isinstance(m, (quant.QuantMatmul, quant.QuantSDPA)) for m in q.modules())
    assert sorted(quant.quantized_layers(q)) == ["attn.proj", "attn.qkv", "attn.residual_add0", "embed", "head",
                                                 "residual_add0"]
    # with only matmuls selected and the option off there is nothing to quantize: the model is untouched
    off = quant.quantize(copy.deepcopy(model), _only_matmuls("int8").replace(quantize_matmuls=False))
    assert quant.quantized_layers(off) == [] and type(off.attn) is _Attention


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_qk_and_pv_match_hand_fake_quant(digits, fmt: str) -> None:
    torch.manual_seed(0)
    block = _Attention(32, 2).eval()
    calib = torch.randn(16, 8, 32)
    q = quant.quantize(copy.deepcopy(block), _only_matmuls(fmt), forward_loop=lambda m: m(calib))
    assert [(n, m.op) for n, m in q.named_modules() if isinstance(m, quant.QuantMatmul)] == \
        [("matmul0", "matmul"), ("matmul1", "matmul")]
    amax = [q.matmul0.input_quantizer.amax, q.matmul0.other_quantizer.amax,
            q.matmul1.input_quantizer.amax, q.matmul1.other_quantizer.amax]
    x = torch.randn(4, 8, 32) * 1.5  # beyond the calibrated range too: clipping is part of the reference
    with torch.no_grad():
        out, ref, flt = q(x), _reference(block, x, amax, fmt), block(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert (out - flt).abs().max() > 1e-4  # the quantizers do act
    q.matmul0.input_quantizer.enabled = False  # disabling one operand's quantizer removes exactly its rounding
    with torch.no_grad():
        torch.testing.assert_close(q(x), _reference(block, x, [None, *amax[1:]], fmt), rtol=0, atol=1e-6)


def test_calibration_sets_and_updates_amax() -> None:
    torch.manual_seed(0)
    block = _Attention(32, 2).eval()
    calib = torch.randn(16, 8, 32)
    q = quant.quantize(copy.deepcopy(block), _only_matmuls("int8"))
    assert not q.matmul0.input_quantizer.is_calibrated
    with pytest.raises(UsageError, match="not calibrated"):
        q(calib)

    def operands(x: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            qq, k, v = block.heads(x)
            p = ((qq @ k.transpose(-2, -1)) / math.sqrt(block.hs)).softmax(-1)
        return [qq, k.transpose(-2, -1), p, v]

    quant.calibrate(q, lambda m: m(calib))  # max calibration: amax = max |operand| over the data
    got = [q.matmul0.input_quantizer.amax, q.matmul0.other_quantizer.amax,
           q.matmul1.input_quantizer.amax, q.matmul1.other_quantizer.amax]
    for g, t in zip(got, operands(calib)):
        torch.testing.assert_close(g, t.abs().max(), rtol=1e-6, atol=0)
    quant.calibrate(q, lambda m: m(3 * calib))  # recalibration on other data moves every amax
    for g, t in zip([q.matmul0.input_quantizer.amax, q.matmul1.other_quantizer.amax], operands(3 * calib)[::3]):
        torch.testing.assert_close(g, t.abs().max(), rtol=1e-6, atol=0)
    before = float(q.matmul0.input_quantizer.amax)
    quant.load_calib_amax(q, "percentile", 99.0)  # the same histograms serve every calibrator
    assert 0 < float(q.matmul0.input_quantizer.amax) < before


def test_sdpa_inputs_quantized() -> None:
    torch.manual_seed(0)
    block = _Attention(32, 2, sdpa=True).eval()
    calib = torch.randn(16, 8, 32)
    q = quant.quantize(copy.deepcopy(block), _only_matmuls("int8"), forward_loop=lambda m: m(calib))
    assert isinstance(q.sdpa0, quant.QuantSDPA)
    x = torch.randn(4, 8, 32)
    with torch.no_grad():
        qq, k, v = block.heads(x)
        y = F.scaled_dot_product_attention(_fq(qq, q.sdpa0.q_quantizer.amax), _fq(k, q.sdpa0.k_quantizer.amax),
                                           _fq(v, q.sdpa0.v_quantizer.amax), is_causal=True)
        ref = x + block.proj(y.transpose(1, 2).reshape(4, 8, 32))
        torch.testing.assert_close(q(x), ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(q.sdpa0.k_quantizer.amax, block.heads(calib)[1].abs().max(), rtol=1e-6, atol=0)


class _WeightMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t()  # a weight, not an activation: not an attention matmul


class _OptionalMask(nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        att = q @ q.transpose(-2, -1)
        return att if mask is None else att + mask


def test_weight_matmul_skipped_and_untraceable_reported() -> None:
    q = quant.quantize(_WeightMatmul(), quant.INT8_ATTENTION)
    assert quant.quantized_layers(q) == []
    model = nn.Sequential(_OptionalMask())
    q = quant.quantize(model, quant.INT8_ATTENTION)
    assert quant.summary(q)["untraced"] == ["0"]
    with pytest.raises(UsageError, match="quantize_matmuls"):
        quant.QuantConfig(quantize_matmuls="yes")  # type: ignore[arg-type]


def test_summary_lists_matmuls(trained_attention, digits) -> None:
    from rich.console import Console

    calib = digits.calibration_batches(n=2)
    q = quant.quantize(copy.deepcopy(trained_attention), quant.INT8_ATTENTION, forward_loop=lambda m: [m(x) for x in calib])
    rows = {r.name: r for r in quant.summary(q)["layers"]}
    assert rows["attn.matmul0"].kind == "QuantMatmul (matmul: A @ B)"
    assert rows["attn.matmul0"].input_amax == pytest.approx(float(q.attn.matmul0.input_quantizer.amax))
    assert rows["attn.matmul1"].weight_amax == f"B {float(q.attn.matmul1.other_quantizer.amax):.4g}"
    buf = io.StringIO()
    quant.print_summary(q, console=Console(file=buf, width=200))
    assert "attn.matmul0" in buf.getvalue() and "attn.matmul1" in buf.getvalue()
    # sensitivity and partial quantization see the matmuls as layers
    assert {"attn.matmul0", "attn.matmul1"} <= set(quant.quantized_layers(q))
    quant.set_quantizers_enabled(q, False, ["attn.matmul1"])
    assert not q.attn.matmul1.input_quantizer.enabled and not q.attn.matmul1.other_quantizer.enabled


def test_accuracy_with_quantized_attention(trained_attention, digits, accuracy) -> None:
    """int8 attention matmuls on top of int8 layers cost at most 1 point on the digits test set."""
    base = accuracy(trained_attention, digits)
    assert base >= 0.9  # the model did learn
    calib = digits.calibration_batches(n=4)
    layers = quant.quantize(copy.deepcopy(trained_attention), quant.INT8_DEFAULT, forward_loop=lambda m: [m(x) for x in calib])
    full = quant.quantize(copy.deepcopy(trained_attention), quant.INT8_ATTENTION, forward_loop=lambda m: [m(x) for x in calib])
    assert abs(accuracy(full, digits) - accuracy(layers, digits)) <= 0.01
    assert accuracy(full, digits) >= base - 0.02
    with torch.no_grad():
        diff = (full(digits.x_test) - layers(digits.x_test)).abs().max()
    assert diff > 0  # the matmul quantizers changed the logits


def test_export_qdq_on_both_matmul_inputs_and_ort_match(trained_attention, digits, tmp_path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    calib = digits.calibration_batches(n=4)
    q = quant.quantize(copy.deepcopy(trained_attention), quant.INT8_ATTENTION, forward_loop=lambda m: [m(x) for x in calib])
    path = quant.export_onnx(q, (digits.x_test[:1],), tmp_path / "attn_int8.onnx")
    g = onnx.load(str(path)).graph
    prod = {o: n for n in g.node for o in n.output}
    weights = {t.name for t in g.initializer}
    matmuls = [n for n in g.node if n.op_type in ("MatMul", "Gemm")]

    def dq(name: str) -> bool:  # DequantizeLinear, or a Transpose of one (a 3-D Linear's weight)
        n = prod.get(name)
        return n is not None and (n.op_type == "DequantizeLinear" or (n.op_type == "Transpose" and dq(n.input[0])))

    def from_weight(name: str) -> bool:  # the DQ(Q(initializer)) chain of a Linear weight
        n = prod.get(name)
        return name in weights or (n is not None and n.op_type in ("DequantizeLinear", "QuantizeLinear", "Transpose")
                                   and from_weight(n.input[0]))

    for n in matmuls:  # every MatMul/Gemm input (activations and weights) is dequantized
        assert dq(n.input[0]) and dq(n.input[1]), n.name
    attn = [n for n in matmuls if not any(from_weight(i) for i in n.input[:2])]
    assert len(attn) == 2  # QK^T and PV: DequantizeLinear feeds both operands directly
    assert all(prod[i].op_type == "DequantizeLinear" for n in attn for i in n.input[:2])
    # ORT_ENABLE_BASIC: ORT 1.32's extended QDQ fusions miscompute the DQ -> Transpose -> MatMul chain
    # of any QuantLinear on a 3-D input (also without quantized matmuls: max error ~half the output's
    # range on a lone Linear(8, 32)); with basic optimizations ORT equals the fake-quant model
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": digits.x_test.numpy()})[0]
    with torch.no_grad():
        ref = q(digits.x_test).numpy()
    diff = np.abs(got - ref)  # the tolerance of test_export.py's int8 CNN test
    assert np.quantile(diff, 0.95) <= 1e-4
    assert diff.max() <= 0.02 * np.abs(ref).max()
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.995


def test_export_matmul_only_ort_default_optimizations(tmp_path) -> None:
    """Only the attention matmuls quantized: ORT with all its (QDQ-fusing) optimizations matches."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    block = _Attention(32, 2).eval()
    calib, x = torch.randn(16, 8, 32), torch.randn(32, 8, 32)
    q = quant.quantize(copy.deepcopy(block), _only_matmuls("int8"), forward_loop=lambda m: m(calib))
    path = quant.export_onnx(q, (x[:1],), tmp_path / "mm_int8.onnx")
    g = onnx.load(str(path)).graph
    prod = {o: n for n in g.node for o in n.output}
    mms = [n for n in g.node if n.op_type == "MatMul" and all(prod.get(i) is not None and
                                                               prod[i].op_type == "DequantizeLinear" for i in n.input)]
    assert len(mms) == 2 and sum(n.op_type == "QuantizeLinear" for n in g.node) == 4
    _assert_ort_matches(ort, path, q, x)


def _assert_ort_matches(ort, path, q, x) -> None:
    """ONNX Runtime on the exported Q/DQ graph equals the fake-quant model: 95% of outputs within 1e-4,
    all within 2% of the largest."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        ref = q(x).numpy()
    diff = np.abs(got - ref)
    assert np.quantile(diff, 0.95) <= 1e-4 and diff.max() <= 0.02 * np.abs(ref).max()


def test_sdpa_export_ort_match(tmp_path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    block = _Attention(32, 2, sdpa=True).eval()
    calib, x = torch.randn(16, 8, 32), torch.randn(32, 8, 32)
    q = quant.quantize(copy.deepcopy(block), _only_matmuls("int8"), forward_loop=lambda m: m(calib))
    path = quant.export_onnx(q, (x[:1],), tmp_path / "sdpa_int8.onnx")
    g = onnx.load(str(path)).graph
    assert sum(n.op_type == "QuantizeLinear" for n in g.node) == 3  # q, k, v
    _assert_ort_matches(ort, path, q, x)
