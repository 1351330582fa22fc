"""ONNX export: Q/DQ placement (TensorRT rules), checker, and ONNX Runtime vs the fake-quant model."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive import quant
from overdrive._utils.errors import OverdriveError, UsageError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def int8_cnn(trained_cnn, digits):
    calib = digits.calibration_batches(n=4)
    return quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT, forward_loop=lambda m: [m(x) for x in calib])


def _producers(graph) -> dict[str, object]:
    return {o: n for n in graph.node for o in n.output}


def _init(graph, name: str) -> np.ndarray | None:
    from onnx import numpy_helper

    for t in graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return numpy_helper.to_array(n.attribute[0].t)
    return None


def test_int8_export_placement_and_ort_match(int8_cnn, digits, tmp_path) -> None:
    path = quant.export_onnx(int8_cnn, (digits.x_test[:1],), tmp_path / "cnn_int8.onnx")
    g = onnx.load(str(path)).graph
    prod = _producers(g)
    # Every Conv/Gemm input (activation and weight) comes from a DequantizeLinear.
    for n in g.node:
        if n.op_type in ("Conv", "Gemm"):
            assert prod[n.input[0]].op_type == "DequantizeLinear", n.name
            assert prod[n.input[1]].op_type == "DequantizeLinear", n.name
    # Each residual Add has exactly one quantized input (the residual); the other is the BN output.
    adds = [n for n in g.node if n.op_type == "Add"]
    assert len(adds) == 2
    for n in adds:
        kinds = sorted(prod[i].op_type for i in n.input)
        assert kinds == ["BatchNormalization", "DequantizeLinear"], kinds
    # Zero points are 0; weight quantizers are per channel (axis 0, one scale per output channel).
    qs = [n for n in g.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == 2 * 8 + 2
    for n in qs:
        assert not np.any(_init(g, n.input[2]))
    per_channel = [n for n in qs if (_init(g, n.input[1]) is not None and _init(g, n.input[1]).size > 1)]
    assert len(per_channel) == 8
    assert all(a.i == 0 for n in per_channel for a in n.attribute if a.name == "axis")
    # ONNX Runtime agrees with the fake-quant model: 95% of logits within 1e-4 (float summation
    # order), all within 2% of the largest logit (a rounding tie can flip one int8 step inside the
    # net), argmax identical on >= 99.5% of the test set.
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": digits.x_test.numpy()})[0]
    with torch.no_grad():
        ref = int8_cnn(digits.x_test).numpy()
    diff = np.abs(got - ref)
    assert np.quantile(diff, 0.95) <= 1e-4
    assert diff.max() <= 0.02 * np.abs(ref).max()
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.995


def test_fp8_export_opset19(trained_cnn, digits, tmp_path) -> None:
    calib = digits.calibration_batches(n=2)
    q = quant.quantize(copy.deepcopy(trained_cnn), quant.FP8_DEFAULT, forward_loop=lambda m: [m(x) for x in calib])
    with pytest.raises(UsageError, match="opset >= 19"):
        quant.export_onnx(q, (digits.x_test[:1],), tmp_path / "x.onnx", opset=17)
    path = quant.export_onnx(q, (digits.x_test[:1],), tmp_path / "cnn_fp8.onnx")
    m = onnx.load(str(path))
    assert m.opset_import[0].version == 19
    qs = [n for n in m.graph.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == 18
    zp = _init(m.graph, qs[0].input[2])
    assert zp is not None and "float8" in str(zp.dtype).lower()  # fp8 zero point
    opts = ort.SessionOptions()  # ORT_ENABLE_ALL's QDQ fusions miscompute fp8 Q/DQ around Conv (ORT 1.32)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    try:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"this onnxruntime cannot load fp8 Q/DQ on CPU: {exc}")
    got = sess.run(None, {"input": digits.x_test[:64].numpy()})[0]
    with torch.no_grad():
        ref = q(digits.x_test[:64]).numpy()
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.98
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()


def test_export_before_calibration_raises(trained_cnn, tmp_path) -> None:
    q = quant.quantize(copy.deepcopy(trained_cnn), quant.INT8_DEFAULT)
    with pytest.raises(UsageError, match="before calibration"):
        quant.export_onnx(q, (torch.randn(1, 1, 8, 8),), tmp_path / "x.onnx")
    with pytest.raises(UsageError, match="no enabled quantizers"):
        quant.export_onnx(nn.Linear(2, 2), (torch.randn(1, 2),), tmp_path / "x.onnx")


class _Histc(nn.Module):
    """An op neither ONNX exporter writes (torch.fft.fft, used here before, the torch.export-based one does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.histc(x, bins=4).expand(x.shape[0], 4)


def test_unsupported_op_names_op_and_module(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(8, 8), _Histc())
    q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(4, 8)))
    with pytest.raises(OverdriveError, match=r"histc.*module '1'"):
        quant.export_onnx(q, (torch.randn(2, 8),), tmp_path / "x.onnx")


class _Bessel(nn.Module):
    """torch.special.i0: the exporter names it aten::i0, not the Python call's name (special_i0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.i0(x)


def test_unsupported_op_named_by_its_aten_alias_names_the_module(tmp_path) -> None:
    """The owner was looked up by the Python call's name only, so an op the exporter names by its aten name
    (torch.special.i0 -> aten::i0) said "used in module '?'"."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), _Bessel()))
    q = quant.quantize(model, quant.INT8_DEFAULT, forward_loop=lambda m: m(torch.randn(4, 8)))
    with pytest.raises(OverdriveError, match=r"op 'i0' used in module '1\.1'"):
        quant.export_onnx(q, (torch.randn(2, 8),), tmp_path / "x.onnx")


def _fq(x: torch.Tensor, amax: torch.Tensor, qmin: int) -> torch.Tensor:
    """Reference int8 fake quantization: per tensor (amax ()) or per row (amax (C,)), scale amax / 127."""
    s = amax / 127 if amax.dim() == 0 else (amax / 127).view(-1, 1)
    return torch.clamp(torch.round(x / s), qmin, 127) * s


@pytest.mark.parametrize("narrow_input", [False, True])
def test_narrow_range_export_matches_pytorch_after_qat(narrow_input: bool, tmp_path) -> None:
    """ONNX Q/DQ can only say [-128, 127]; narrow-range quantizers ([-127, 127]: INT8_DEFAULT's weights,
    here also the inputs) must still agree with PyTorch once values lie beyond -amax: weights after
    QAT steps (amax fixed) and activations larger than the calibration data."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 8, (64,))
    cfg = quant.INT8_DEFAULT.replace(input=quant.QuantizerConfig(narrow_range=narrow_input))
    q = quant.quantize(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)), cfg, forward_loop=lambda m: m(x))
    # as calibrated (|w| <= amax) the weight initializers feed QuantizeLinear directly (no Min/Max)
    g = onnx.load(str(quant.export_onnx(q, (x[:2],), tmp_path / "ptq.onnx"))).graph
    inits = {i.name for i in g.initializer}
    assert sum(n.op_type == "QuantizeLinear" and n.input[0] in inits for n in g.node) == 2
    quant.qat(q, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], epochs=1, lr=0.1)  # large lr: weights move
    wq = []
    for lin in (q[0], q[2]):
        w, amax = lin.weight.detach(), lin.weight_quantizer.amax
        assert (w < -127.5 * (amax / 127).view(-1, 1)).any()  # [-128, 127] would give -128 here: the case tested
        wq.append(_fq(w, amax, -127))
    x_test = 3 * torch.randn(32, 16)  # beyond the calibrated input amax on both sides
    qmin = -127 if narrow_input else -128
    h = torch.relu(F.linear(_fq(x_test, q[0].input_quantizer.amax, qmin), wq[0], q[0].bias.detach()))
    ref = F.linear(_fq(h, q[2].input_quantizer.amax, qmin), wq[1], q[2].bias.detach())
    path = quant.export_onnx(q, (x_test[:2],), tmp_path / "qat.onnx")
    opts = ort.SessionOptions()  # plain Q/DQ arithmetic: no fused integer GEMM (see the README's ORT note)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    got = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, {"input": x_test.numpy()})[0]
    with torch.no_grad():
        out = q(x_test)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(got), out, rtol=0, atol=1e-5)


def _per_output_channel_reference(w: torch.Tensor, groups: int) -> torch.Tensor:
    """A ConvTranspose weight (C_in, C_out/groups, kH, kW) fake-quantized with one [-127, 127] scale per
    output channel, in float64: output channel g * C_out/groups + j is w[g-th block of C_in, j]."""
    c_in, c_og = w.shape[:2]
    wg = w.double().view(groups, c_in // groups, c_og, *w.shape[2:])
    s = wg.abs().amax(dim=(1, 3, 4), keepdim=True) / 127  # (groups, 1, C_out/groups, 1, 1)
    return (torch.round(wg / s).clamp(-127, 127) * s).view_as(w)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_conv_transpose_weights_per_output_channel_and_ort(groups: int, tmp_path) -> None:
    """ConvTranspose2d weights get one scale per output channel (axis 1, C_out scales, equal to a float64
    reference) and export with that axis, ORT matching PyTorch. With groups > 1 per-output-channel is not
    expressible on the (C_in, C_out/groups, kH, kW) layout: the layer stays float with the reason in the
    summary (it used to get C_out/groups scales, each shared across the groups), and per-tensor weights
    quantize it and export."""
    torch.manual_seed(0)
    ct = nn.ConvTranspose2d(4, 8, 3, stride=2, groups=groups)
    with torch.no_grad():
        ct.weight[: 4 // groups] *= 10.0  # the first group's weights are 10x larger than the rest
    x = torch.randn(2, 4, 5, 5)
    q = quant.quantize(nn.Sequential(copy.deepcopy(ct), nn.Conv2d(8, 2, 1)), quant.INT8_DEFAULT,
                       forward_loop=lambda m: m(x))
    if groups == 1:
        wq = q[0].weight_quantizer
        assert wq.axis == 1 and wq.amax.shape == (8,)
        torch.testing.assert_close(wq(q[0].weight).double(), _per_output_channel_reference(ct.weight.detach(), 1),
                                   rtol=0, atol=1e-6)
        path = quant.export_onnx(q, (x,), tmp_path / "ct.onnx")
        g = onnx.load(str(path)).graph
        deq = _producers(g)[next(n for n in g.node if n.op_type == "ConvTranspose").input[1]]
        assert deq.op_type == "DequantizeLinear" and onnx.helper.get_attribute_value(deq.attribute[0]) == 1
        assert _init(g, deq.input[1]).shape == (8,)
        with torch.no_grad():
            ref = q(x).numpy()
        out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
        # equal to float rounding, except where the ConvTranspose output lands within float error of a rounding
        # boundary of the next layer's input quantizer: one int8 step of it there (its amax / 127 times |w|), rarely
        diff = np.abs(out - ref)
        step = float(q[1].input_quantizer.amax) / 127 * float(q[1].weight.abs().sum(dim=(1, 2, 3)).max())
        assert diff.max() <= step * 1.01 and (diff > 1e-4).mean() <= 0.01, (diff.max(), step, (diff > 1e-4).mean())
        return
    assert type(q[0]) is nn.ConvTranspose2d  # left in float, and said why
    reason = quant.summary(q)["skipped"]["0"]
    assert f"groups={groups}" in reason and "per_channel=False" in reason
    with pytest.raises(UsageError, match=f"groups={groups}"):
        quant.QuantConvTranspose2d.from_float(copy.deepcopy(ct), quant.INT8_DEFAULT)
    with pytest.raises(UsageError, match=f"found no layer to quantize .*groups={groups}"):  # not "call quantize first"
        quant.quantize(nn.Sequential(copy.deepcopy(ct)), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    per_tensor = quant.INT8_DEFAULT.replace(weight=quant.QuantizerConfig(per_channel=False, narrow_range=True))
    q = quant.quantize(nn.Sequential(copy.deepcopy(ct)), per_tensor, forward_loop=lambda m: m(x))
    assert type(q[0]) is quant.QuantConvTranspose2d and q[0].weight_quantizer.amax.dim() == 0
    path = quant.export_onnx(q, (x,), tmp_path / "ct_per_tensor.onnx")
    with torch.no_grad():
        ref = q(x).numpy()
    out = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]
    np.testing.assert_allclose(out, ref, atol=1e-4)


def test_export_restores_each_modules_training_flag(tmp_path) -> None:
    """export_onnx runs in eval mode and gives every submodule its own flag back (a frozen BN stays frozen)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(144, 2))
    x = torch.randn(4, 3, 8, 8)
    m = quant.quantize(m, quant.INT8_DEFAULT, forward_loop=lambda mm: mm(x))
    m.train()
    m[1].eval()
    quant.export_onnx(m, (x[:1],), tmp_path / "m.onnx")
    assert m.training and m[2].training and not m[1].training


@pytest.mark.parametrize("narrow", [False, True])
def test_torch_onnx_export_with_its_default_exporter_writes_q_dq(narrow: bool, tmp_path) -> None:
    """A script that calls ``torch.onnx.export`` itself (pytorch-quantization's recipe), with the torch.export-based
    exporter that is torch's default since 2.9: the quantizers are QuantizeLinear / DequantizeLinear, not the
    Mul/Round/Clip arithmetic it wrote before (which a TensorRT-style builder runs in float), and ONNX Runtime
    computes what the fake-quantized model computes (within 1e-5 of the output range)."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 3, 16, 16)
    cfg = quant.QuantConfig(weight=quant.QuantizerConfig(per_channel=True, narrow_range=narrow),
                            input=quant.QuantizerConfig(narrow_range=narrow))
    q = quant.quantize(m, cfg, forward_loop=lambda mod: mod(x), fidelity=False)
    path = tmp_path / "dynamo.onnx"
    torch.onnx.export(q, (x,), str(path), dynamo=True)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("QuantizeLinear") >= 4 and ops.count("DequantizeLinear") >= 4, ops
    assert "Round" not in ops
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = q(x).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


class _WithDiff(nn.Module):
    """A model with an op the TorchScript exporter cannot write at opset 17 (``aten::diff``, as in transformers 5's
    Llama mask code)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(15, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(torch.diff(self.a(x), dim=-1)))


@pytest.mark.parametrize("preset, opset", [("INT8_DEFAULT", None), ("FP8_DEFAULT", None)])
def test_export_falls_back_to_the_dynamo_exporter_with_q_dq(preset: str, opset, tmp_path) -> None:
    """export_onnx of a model the TorchScript exporter cannot take: torch's torch.export-based exporter writes it,
    quantizers as QuantizeLinear/DequantizeLinear (int8 and fp8), the batch dim still dynamic; ONNX Runtime equals
    the fake-quantized model within 1e-5 of the output range at another batch size. It raised "cannot express op
    'diff'" before."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    q = quant.quantize(_WithDiff().eval(), getattr(quant, preset), forward_loop=lambda m: m(x), fidelity=False)
    path = quant.export_onnx(q, (x,), tmp_path / "diff.onnx", opset=opset)
    g = onnx.load(str(path)).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("QuantizeLinear") >= 2 and ops.count("DequantizeLinear") >= 2 and "Round" not in ops, ops
    assert g.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x3 = torch.randn(3, 8)
    with torch.no_grad():
        want = q(x3).numpy()
    if preset == "FP8_DEFAULT":  # ONNX's own reference evaluator: ONNX Runtime's extended graph optimizations
        from onnx.reference import ReferenceEvaluator  # (ORT_ENABLE_ALL, its default) break fp8 Q/DQ here

        got = ReferenceEvaluator(str(path)).run(None, {g.input[0].name: x3.numpy()})[0]
    else:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = sess.run(None, {g.input[0].name: x3.numpy()})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_exported_weights_keep_the_models_names(tmp_path: Path) -> None:
    """A model whose forward takes ``input`` (nn.Sequential) is exported through a by-name wrapper, and its weights
    came out as ``module.0.weight``: readers of the file by name (a weight-sparsity check) did not find them."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    q = quant.quantize(model, quant.INT8_DEFAULT, lambda m: m(x))
    path = quant.export_onnx(q, (x,), tmp_path / "seq.onnx")
    names = {t.name for t in onnx.load(str(path)).graph.initializer}
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= names and not any(n.startswith("module.") for n in names)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = q(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert float(abs(got - ref).max()) <= 1e-5  # the same Q/DQ arithmetic
