"""2:4 sparsity together with overdrive.quant ("sparse-quantized") and overdrive.engine, on the demo
digits CNN: fake-quantized weights keep the pattern (against a hand-computed per-channel
reference), QAT keeps the masks, the ONNX Q/DQ export and the onnxruntime engines hold 2:4 weights,
and engine.compare passes against the PyTorch model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant, sparsity
from overdrive._utils.errors import UsageError
from overdrive.recipes.models import DigitsCNN

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

PRUNED = ["block1.conv1.0.weight", "block1.conv2.0.weight", "down.0.weight", "block2.conv1.0.weight",
          "block2.conv2.0.weight", "fc1.weight"]  # stem (in=1) and fc2 (out=10) fail the shape rule


@pytest.fixture(scope="module")
def digits():
    from overdrive.recipes.data import load_digits

    return load_digits()


@pytest.fixture(scope="module")
def dense(digits) -> nn.Module:
    """The digits CNN trained for one epoch in fp32 (about 2 s)."""
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train, _ = digits.loaders(batch_size=64, seed=0)
    for x, y in train:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


def _calib(digits):
    batches = [digits.x_train[i:i + 64] for i in range(0, 128, 64)]
    return lambda m: [m(x) for x in batches]


def _accuracy(model: nn.Module, digits) -> float:
    with torch.no_grad():
        return float((model.eval()(digits.x_test).argmax(1) == digits.y_test).float().mean())


def _sparse_quantized(dense: nn.Module, digits, config=quant.INT8_DEFAULT):
    model = copy.deepcopy(dense)
    handle = sparsity.sparsify(model)
    return sparsity.sparse_quantize(handle, config, _calib(digits)), handle


def _groups(mask: torch.Tensor) -> torch.Tensor:
    m = sparsity.masks.to_matrix(mask)
    return m.reshape(m.shape[0], -1, 4).sum(-1)


@pytest.mark.parametrize("config", [quant.INT8_DEFAULT, quant.FP8_DEFAULT,
                                    quant.INT8_DEFAULT.replace(weight=quant.QuantizerConfig(per_channel=False))],
                         ids=["int8-per-channel", "fp8-per-channel", "int8-per-tensor"])
def test_fake_quantized_weights_keep_2to4(dense, digits, config) -> None:
    model, handle = _sparse_quantized(dense, digits, config)
    assert [layer.name for layer in handle.layers] == PRUNED
    for layer in handle.layers:
        mod = model.get_submodule(layer.name.rsplit(".", 1)[0])
        assert layer.module is mod and type(mod).__name__.startswith("Quant")
        assert layer.weight is mod.weight and layer.original is mod.weight  # same Parameter through the swap
        wq = mod.weight_quantizer(mod.weight.detach())
        assert bool((wq[~layer.mask] == 0).all()) and sparsity.is_2to4(wq)
        assert bool((_groups(layer.mask) == 2).all())  # the masks: exactly 2 kept of every 4
        # reference: symmetric quantize-dequantize with amax = max |w| (per output channel or per tensor)
        w = mod.weight.detach()
        amax = w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True) if config.weight.per_channel else w.abs().max()
        if config.weight.format == "int8":
            s = amax / 127
            lo = -127 if config.weight.narrow_range else -128
            ref = (w / s).round().clamp(lo, 127) * s
        else:
            s = amax / 448
            ref = (w / s).to(torch.float8_e4m3fn).float() * s
        torch.testing.assert_close(wq, ref, atol=1e-6, rtol=1e-5)
        kept = int((wq != 0).sum())
        assert kept >= 0.95 * int(layer.mask.sum())  # quantization rounds few kept weights to zero
    handle.verify()


def test_handle_follows_the_swap_for_load_checks(dense, digits) -> None:
    model, handle = _sparse_quantized(dense, digits)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # a consistent checkpoint loads
    key = "block1.conv1.0.weight"
    state[key][~state["block1.conv1.0.weight_sparse_mask"]] = 1.0
    with pytest.raises(UsageError, match="nonzero where its mask prunes"):
        model.load_state_dict(state)  # checked on the QuantConv2d now in the model


def test_verify_rebinds_after_plain_quantize_and_catches_broken_quantized_weight(dense, digits) -> None:
    model = copy.deepcopy(dense)
    handle = sparsity.sparsify(model)
    model = quant.quantize(model, quant.INT8_DEFAULT, _calib(digits))  # without sparse_quantize
    handle.verify()
    assert handle.layers[0].module is model.block1.conv1[0]
    # a quantizer that does not map 0 to 0 (a broken amax is not enough: use a nonzero zero point)
    mod = model.fc1
    mod.weight_quantizer.forward = lambda x: x + 1e-3  # instance attribute on a test object, not a library patch
    with pytest.raises(UsageError, match="quantized weight of fc1.weight is not 2:4"):
        handle.verify()


def test_workflow_prune_finetune_quantize_qat_export(dense, digits, tmp_path) -> None:
    model = copy.deepcopy(dense)
    handle = sparsity.sparsify(model)
    train, _ = digits.loaders(batch_size=64, seed=0)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle.attach(opt)
    for x, y in train:  # one epoch of fine-tuning with masks held
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    handle.verify()
    model = sparsity.sparse_quantize(handle, quant.INT8_DEFAULT, _calib(digits))
    before = {layer.name: layer.weight.detach().clone() for layer in handle.layers}
    quant.qat(model, list(train)[:5], epochs=1, lr=1e-4, attach=handle.attach)
    handle.verify()  # masks held through QAT, fake-quantized weights still 2:4
    for layer in handle.layers:
        assert not torch.equal(layer.weight.detach(), before[layer.name])  # QAT did train the kept weights
        assert bool((layer.weight[~layer.mask] == 0).all())
    assert _accuracy(model, digits) >= _accuracy(dense, digits) - 0.005  # the target: within 0.5 points
    path = quant.export_onnx(model, (digits.x_test[:4],), tmp_path / "digits_sparse_int8.onnx")
    rows = sparsity.onnx_weight_sparsity(path, handle)
    assert [r["name"] for r in rows] == PRUNED
    assert all(r["is_2to4"] and r["nonzero_fraction"] <= 0.5 for r in rows)
    from overdrive.engine import compare

    r = compare(str(path), model, (digits.x_test[:16],), atol=1e-4, rtol=1e-4)
    assert r["passed"], r


def test_qat_without_the_hook_loses_the_masks(dense, digits) -> None:
    """The control for the test above: QAT's optimizer moves pruned weights unless the handle is attached."""
    model, handle = _sparse_quantized(dense, digits)
    train, _ = digits.loaders(batch_size=64, seed=0)
    quant.qat(model, list(train)[:2], epochs=1, lr=1e-3)
    with pytest.raises(UsageError, match="nonzero where its mask prunes"):
        handle.verify()


def test_engine_pruned_fp32_and_sparse_int8(dense, digits) -> None:
    import onnx
    from onnx import numpy_helper

    from overdrive.engine import Builder, compare

    x = digits.x_test[:16]
    pruned = copy.deepcopy(dense)
    handle = sparsity.sparsify(pruned)
    eng = Builder(precision="fp32", device="cpu").build(pruned, (x,))
    assert eng.info["backend"] == "onnxruntime"
    r = compare(eng, pruned, (x,), atol=1e-4, rtol=1e-4)
    assert r["passed"], r
    sq = sparsity.sparse_quantize(handle, quant.INT8_DEFAULT, _calib(digits))
    eng = Builder(precision="int8", device="cpu").build(sq, (x,))  # exported with the model's own calibration
    # ORT runs integer kernels (requantized activations): close to the fake-quant model, not bitwise
    r = compare(eng, sq, (x,), atol=2e-2, rtol=1e-2)
    assert r["passed"], r
    assert r["outputs"][0]["median_rel"] < 1e-4
    from overdrive.engine.backends.onnxruntime import int8_kernels_exact

    graph = onnx.load_from_string(eng.sections["onnx"]).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    if int8_kernels_exact()[0]:  # ORT's optimizer folded Q(W) into int8 weights for its integer kernels
        weights = [torch.from_numpy(a.astype("float32")) for a in inits.values() if a.ndim >= 2 and a.dtype.name == "int8"]
        assert len(weights) == 8  # every conv/linear weight
        assert sum(sparsity.is_2to4(w) for w in weights) == len(PRUNED)
    else:  # x86 without VNNI (ORT's u8s8 kernels saturate): weights stored dequantized, convs in ORT's blocked
        # NCHWc layout, so the 2:4 pattern is checked as half of each pruned weight being zero
        weights = [torch.from_numpy(a.copy()) for a in inits.values() if a.ndim >= 2 and a.dtype.name == "float32"]
        assert len(weights) == 8
        assert sum(float((w == 0).float().mean()) >= 0.5 for w in weights) == len(PRUNED)


def test_inductor_int8_prepare_keeps_the_models_calibration(dense, digits) -> None:
    """The inductor backend's int8 path (GPU default) converts an already-quantized model as calibrated:
    no second quantize (which refuses a quantized model), same amax; checked here without compiling."""
    from overdrive.engine.backends.prepare import prepare
    from overdrive.engine.config import BuildConfig
    from overdrive.engine.sources import from_module

    sq, _ = _sparse_quantized(dense, digits)
    real = prepare(from_module(sq), BuildConfig(precision="int8", device="cpu", backend="inductor"),
                   torch.device("cpu"), calib=[(torch.zeros(2, 1, 8, 8),)])
    x = digits.x_test[:16]
    with torch.no_grad():
        ref, out = sq.eval()(x), real(x)
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=5e-2)  # int8 GEMM for fc1/fc2, float elsewhere
    assert any(True for _ in quant.quantizers(sq))  # the user's model is left as it was


def test_errors(dense, digits, tmp_path) -> None:
    with pytest.raises(UsageError, match="expects the SparseHandle"):
        sparsity.sparse_quantize(copy.deepcopy(dense), quant.INT8_DEFAULT, _calib(digits))
    model = copy.deepcopy(dense)
    handle = sparsity.sparsify(model)
    with pytest.raises(UsageError, match="selected none of the pruned layers"):
        sparsity.sparse_quantize(handle, quant.INT8_DEFAULT.replace(include=("stem.*", "fc2")), _calib(digits))
    with pytest.raises(UsageError, match="has no layer 'block1.conv1.0'"):
        handle.rebind(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(UsageError, match="has no 2:4 mask buffer"):
        handle.rebind(DigitsCNN())
    with pytest.raises(UsageError, match="does not exist"):
        sparsity.onnx_weight_sparsity(tmp_path / "missing.onnx")
    from overdrive.engine import Builder

    fp8, _ = _sparse_quantized(dense, digits, quant.FP8_DEFAULT)
    with pytest.raises(UsageError, match=r"quantized already to \['fp8_e4m3'\], not int8"):
        Builder(precision="int8", device="cpu").build(fp8, (digits.x_test[:2],))


def test_onnx_weight_sparsity_of_a_sequential(tmp_path) -> None:
    """nn.Sequential's forward takes `input`, export_onnx's default name, so it is exported by keyword through a
    wrapper whose `module.` prefix the initializers carry: the pruned weights are still found (the README's flow)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    handle = sparsity.sparsify(model)
    x = torch.randn(8, 32)
    model = sparsity.sparse_quantize(handle, quant.INT8_DEFAULT, lambda m: m(x))
    path = quant.export_onnx(model, (x,), tmp_path / "seq_int8.onnx")
    rows = sparsity.onnx_weight_sparsity(path, handle)
    assert [r["name"] for r in rows] == ["0.weight", "2.weight"]
    assert all(r["is_2to4"] and r["nonzero_fraction"] <= 0.5 for r in rows)

