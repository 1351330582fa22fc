"""pytorch-quantization scripts with only the import changed (issue 20), checked against overdrive.quant.

The scripts follow the TensorRT samples' shape (``quant_modules.initialize()`` before building the model,
``QuantDescriptor(calib_method="histogram")`` as the default input descriptor, ``collect_stats`` /
``compute_amax`` loops over ``quant_nn.TensorQuantizer`` modules) and are compared with ``quant.quantize``
under the matching QuantConfig: exact equality of amax and outputs (the same calibrators see the same tensors).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive._utils.errors import UsageError
# was: from pytorch_quantization import quant_modules, nn as quant_nn, calib, tensor_quant
from overdrive.quant.pytorch_quantization import calib, quant_modules, tensor_quant
from overdrive.quant.pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import utils as quant_utils
from overdrive.quant.pytorch_quantization.nn.modules import _utils as quant_nn_utils
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.conv2(x)).flatten(1))


DATA = [(torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(i)), None) for i in range(3)]
TEST = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(42))
# pytorch-quantization's numerics: inputs and weights in [-128, 127], weights per output channel
NATIVE = quant.QuantConfig(weight=quant.QuantizerConfig(per_channel=True), residual_add=False,
                           method="percentile", percentile=99.99)


@pytest.fixture(autouse=True)
def restore_class_defaults():
    """set_default_quant_desc_* changes a class for the whole process, as in pytorch-quantization."""
    saved = {c: (c.default_quant_desc_input, c.default_quant_desc_weight)
             for c in (quant_nn.QuantLinear, quant_nn.QuantConv2d)}
    yield
    quant_modules.deactivate()
    for c, (i, w) in saved.items():
        c.default_quant_desc_input, c.default_quant_desc_weight = i, w


def collect_stats(model: nn.Module, data_loader, num_batches: int) -> None:
    """The TensorRT samples' calibration pass, as written there."""
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if module._calibrator is not None:
                module.disable_quant()
                module.enable_calib()
            else:
                module.disable()
    for i, (image, _) in enumerate(data_loader):
        model(image)
        if i >= num_batches:
            break
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if module._calibrator is not None:
                module.enable_quant()
                module.disable_calib()
            else:
                module.enable()


def compute_amax(model: nn.Module, **kwargs) -> None:
    for name, module in model.named_modules():
        if isinstance(module, quant_nn.TensorQuantizer):
            if module._calibrator is not None:
                if isinstance(module._calibrator, calib.MaxCalibrator):
                    module.load_calib_amax()
                else:
                    module.load_calib_amax(**kwargs)


def build_with_quant_modules() -> nn.Module:
    quant_desc_input = QuantDescriptor(calib_method="histogram")
    quant_nn.QuantConv2d.set_default_quant_desc_input(quant_desc_input)
    quant_nn.QuantLinear.set_default_quant_desc_input(quant_desc_input)
    quant_modules.initialize()
    torch.manual_seed(0)
    model = SmallCNN()
    quant_modules.deactivate()
    return model.eval()


def native_model() -> nn.Module:
    """quant.quantize + quant.calibrate with float weights during the pass: the TensorRT loop turns every
    quantizer's quantization off while calibrating, where quant.calibrate keeps the weights fake-quantized."""
    torch.manual_seed(0)
    model = quant.quantize(SmallCNN().eval(), NATIVE)
    weights = [q for n, q in quant.quantizers(model) if n.endswith("weight_quantizer")]
    for q in weights:
        q.enabled = False
    quant.calibrate(model, lambda m: [m(x) for x, _ in DATA], method=NATIVE.method, percentile=NATIVE.percentile)
    for q in weights:
        q.enabled = True
    return model


def assert_same(ported: nn.Module, native: nn.Module) -> None:
    a = {n: q.amax for n, q in quant.quantizers(ported)}
    b = {n: q.amax for n, q in quant.quantizers(native)}
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    with torch.no_grad():
        assert torch.equal(ported(TEST), native(TEST))


def test_trt_sample_calibration_matches_native():
    model = build_with_quant_modules()
    assert type(model.conv1) is quant_nn.QuantConv2d and type(model.fc) is quant_nn.QuantLinear
    assert nn.Conv2d is not quant_nn.QuantConv2d  # deactivate() put torch.nn back
    with torch.no_grad():
        collect_stats(model, DATA, num_batches=len(DATA))
        compute_amax(model, method="percentile", percentile=99.99)
    native = native_model()
    assert_same(model, native)
    # other methods from the stored histograms, without data, as quant.load_calib_amax
    compute_amax(model, method="mse")
    quant.load_calib_amax(native, "mse")
    assert_same(model, native)


def test_trt_loop_reaches_natively_placed_quantizers():
    torch.manual_seed(0)
    model = quant.quantize(SmallCNN().eval(), NATIVE)  # activations not calibrated yet
    assert all(isinstance(q, quant_nn.TensorQuantizer) for _, q in quant.quantizers(model))
    with torch.no_grad():
        collect_stats(model, DATA, num_batches=len(DATA))
        compute_amax(model, method="percentile", percentile=99.99)
    assert_same(model, native_model())


def test_hand_placed_layers_calibrate_with_quant_calibrate():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = quant_nn.QuantLinear(16, 16, quant_desc_input=QuantDescriptor(calib_method="histogram"))
            self.fc2 = quant_nn.QuantLinear(16, 4, quant_desc_weight=QuantDescriptor(axis=(0,)))
            self.residual_quantizer = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.residual_quantizer(x) + torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = Residual()
    data = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    # what quant.calibrate does, by hand: weight amax = max |w| per row, then the activations observed in the
    # float network, every quantizer passing values through (pytorch-quantization's loop, ModelOpt, TensorRT)
    reference = copy.deepcopy(model)
    for fc in (reference.fc1, reference.fc2):
        fc._weight_quantizer.set_amax(fc.weight.detach().abs().amax(1))
    every = [(n, q) for n, q in reference.named_modules() if isinstance(q, quant_nn.TensorQuantizer)]
    acts = [q for n, q in every if not n.endswith("weight_quantizer")]
    with torch.no_grad():
        for _, q in every:
            q.disable_quant()
        for q in acts:
            q.enable_calib()
        for x in data:
            reference(x)
        for q in acts:
            q.load_calib_amax()
            q.disable_calib()
        for _, q in every:
            q.enable_quant()
    with pytest.raises(UsageError, match="quant.calibrate"):
        quant.quantize(model, quant.INT8_DEFAULT)
    quant.calibrate(model, lambda m: [m(x) for x in data])  # weights get max |w|, activations max
    assert model.fc1.weight_quantizer.amax.shape == (16,) and model.fc1._input_quantizer.name == "fc1.input_quantizer"
    for (n, q), (_, r) in zip(quant.quantizers(model), quant.quantizers(reference)):
        assert torch.equal(q.amax, r.amax), n
    with torch.no_grad():
        assert torch.equal(model(data[0]), reference(data[0]))


def test_quant_desc_arguments_and_class_defaults():
    fc = quant_nn.QuantLinear(8, 4, bias=False, quant_desc_input=QuantDescriptor(num_bits=8, calib_method="histogram"),
                              quant_desc_weight=QuantDescriptor(num_bits=8, axis=(0,)))
    assert fc.bias is None and fc._input_quantizer is fc.input_quantizer
    assert isinstance(fc._input_quantizer._calibrator, calib.HistogramCalibrator)
    assert isinstance(fc._weight_quantizer._calibrator, calib.MaxCalibrator) and fc._weight_quantizer.axis == 0
    quant_nn.QuantLinear.set_default_quant_desc_weight(QuantDescriptor(axis=None))
    assert quant_nn.QuantLinear(8, 4)._weight_quantizer.axis is None
    assert quant_nn.QuantConv2d(1, 2, 3)._weight_quantizer.axis == 0  # other classes keep their own default
    with pytest.raises(UsageError, match="weight_only"):
        QuantDescriptor(num_bits=4)
    with pytest.raises(UsageError, match="per tensor"):
        quant_nn.QuantLinear(8, 4, quant_desc_input=QuantDescriptor(axis=(1,)))


def test_fake_tensor_quant_matches_the_pytorch_quantization_formula():
    torch.manual_seed(0)
    x = torch.randn(6, 32, requires_grad=True)
    for amax in (torch.tensor(1.5), x.detach().abs().amax(1, keepdim=True) * 0.8):  # per tensor, per row (6, 1)
        # pytorch-quantization: round(x * 127 / amax) clamped to [-127, 127] (narrow range default), / scale
        scale = 127.0 / amax
        ref = torch.clamp(torch.round(x.detach() * scale), -127, 127) / scale
        out = tensor_quant.fake_tensor_quant(x, amax)
        assert (out - ref).abs().max().item() <= 1e-6  # fp32: x / (amax/127) vs x * (127/amax) differ by an ulp
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(grad, (x.detach().abs() <= amax).float())  # straight-through, clipped at amax
        q, s = tensor_quant.tensor_quant(x.detach(), amax)
        assert torch.equal(q, torch.round(q)) and torch.allclose(q / s, out.detach(), atol=1e-6)


def test_initialize_and_deactivate():
    with quant_modules.enabled(float_module_list=["Linear"]):
        assert nn.Conv2d is quant_nn.QuantConv2d and nn.Linear is not quant_nn.QuantLinear
        model = SmallCNN()
    assert type(model.fc) is nn.Linear and isinstance(model.conv1, nn.Conv2d)
    assert nn.Conv2d.__module__ == "torch.nn.modules.conv"


# --- the qdqbert quant_trainer's private names, keep-dims amax, pooling, calibrators, legacy checkpoints ------
def _fake_int8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """pytorch-quantization's fake quantization in float64, full range [-128, 127], amax broadcast."""
    s = amax.double() / 127
    return (torch.clamp(torch.round(x.double() / s), -128, 127) * s).float()


def test_amax_and_disabled_aliases_and_keepdims_amax():
    torch.manual_seed(0)
    fc = quant_nn.QuantLinear(6, 4)
    q = fc._weight_quantizer
    assert not hasattr(q, "_amax") and not q._disabled  # uncalibrated: no _amax, as in pytorch-quantization
    # recalibrate_weights: reduce_amax(keepdims=True) -> (4, 1) assigned to _amax; the quantizer keeps (4,)
    amax = quant_utils.reduce_amax(fc.weight, axis={1}, keepdims=True)
    assert amax.shape == (4, 1)
    q._amax = amax
    assert q.amax.shape == (4,) and q._amax is q.amax
    torch.testing.assert_close(q(fc.weight), _fake_int8(fc.weight.detach(), amax), rtol=0, atol=1e-7)
    q._amax.fill_(0.5)  # in place on the buffer (fuse_qkv)
    assert torch.equal(q.amax, torch.full((4,), 0.5))
    q.amax = torch.full((4, 1), 0.25)  # ModelOpt-style assignment in keep-dims shape
    assert q.amax.shape == (4,)
    setattr(q, "_disabled", True)
    assert not q.enabled and torch.equal(q(fc.weight), fc.weight)
    with pytest.raises(UsageError, match="per tensor"):
        fc._input_quantizer.amax = torch.ones(3)


def test_axis_compares_equal_to_the_descriptor_tuple():
    """pytorch-quantization keeps ``axis`` as given: ``QuantDescriptor(axis=(0,))`` and the quantizers built from
    it (``TensorQuantizer.axis`` is the descriptor's) give ``(0,)``, so scripts test ``q.axis == (0,)`` and index
    ``q.axis[0]``; its own per-channel constants write ``axis=(0)``, the int 0, which compares equal to 0."""
    desc = QuantDescriptor(num_bits=8, axis=(0,))
    assert desc.axis == (0,) and desc.axis[0] == 0 and isinstance(desc.axis, tuple)
    q = quant_nn.TensorQuantizer(desc)
    assert q.axis == (0,) and q.axis[0] == 0 and tuple(q.axis) == (0,) and q.axis != (1,) and not q.axis != (0,)
    layer = quant_nn.QuantLinear(8, 4, quant_desc_weight=desc)
    assert layer._weight_quantizer.axis == (0,) and layer._weight_quantizer.axis == desc.axis
    assert layer._weight_quantizer.axis != (1,) and layer._input_quantizer.axis is None
    deconv = quant_nn.QuantConvTranspose2d(4, 6, 3)  # QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL: axis=(1)
    assert deconv._weight_quantizer.axis == (1,) and deconv._weight_quantizer.axis == 1
    given_int = QuantDescriptor(axis=0)
    assert given_int.axis == 0 and given_int.axis == (0,) and list(given_int.axis) == [0]
    assert tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW.axis == 0
    # the per-channel numerics are the same whichever way the axis is read: one amax per output row
    x = torch.randn(16, 8)
    quant.calibrate(layer, lambda m: m(x))
    assert torch.equal(layer._weight_quantizer.amax, layer.weight.detach().abs().amax(dim=1))


def test_axis_iterates_like_the_descriptor_and_saves_as_int(tmp_path):
    conv = quant_nn.QuantConv2d(2, 3, 3, quant_desc_weight=QuantDescriptor(axis=(0,)))
    axis = conv._weight_quantizer.axis
    assert axis == 0 and set(axis) == {0} and list(axis) == [0] and len(axis) == 1
    assert conv._input_quantizer.axis is None
    x = torch.randn(2, 2, 5, 5)
    quant.calibrate(conv, lambda m: m(x))
    import overdrive.quant.modelopt.opt as mto

    state = mto.modelopt_state(conv)
    torch.save(state, tmp_path / "s.pt")
    torch.load(tmp_path / "s.pt", weights_only=True)  # plain ints only


def test_reduce_amax_matches_torch():
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1))
    utils = quant_utils
    assert torch.equal(utils.reduce_amax(x), x.abs().max())
    assert torch.equal(utils.reduce_amax(x, axis={1, 2}), x.abs().amax(dim=(1, 2), keepdim=True))
    assert torch.equal(utils.reduce_amax(x, axis=(1, 2), keepdims=False), x.abs().amax(dim=(1, 2)))
    assert utils.reduce_amax(x, axis=[0, 1, 2]).dim() == 0  # one element: squeezed, as there


def test_pytorch_quantization_checkpoint_loads_into_a_fresh_model():
    """Keys ``_input_quantizer._amax`` and per-channel amax in keep-dims shape (what pytorch-quantization saves)."""
    torch.manual_seed(0)
    with quant_modules.enabled():
        model = SmallCNN().eval()
    quant.calibrate(model, lambda m: [m(x) for x, _ in DATA])
    legacy = {}
    for k, v in model.state_dict().items():
        if k.endswith("quantizer.amax"):
            layer, qname, _ = k.rsplit(".", 2)
            w = model.get_submodule(layer).weight
            v = v.reshape(-1, *[1] * (w.dim() - 1)) if v.dim() == 1 else v
            k = f"{layer}._{qname}._amax"
        legacy[k] = v
    with quant_modules.enabled():
        fresh = SmallCNN().eval()
    fresh.load_state_dict(legacy)  # strict: every key placed
    with torch.no_grad():
        assert torch.equal(fresh(TEST), model(TEST))
    # a natively quantized model takes the same checkpoint
    native = quant.quantize(SmallCNN().eval(), quant.QuantConfig(residual_add=False))
    native.load_state_dict(legacy)
    assert torch.equal(native.conv2.weight_quantizer.amax, model.conv2.weight_quantizer.amax)


@pytest.mark.parametrize("name, ref", [("QuantMaxPool2d", lambda x: nn.functional.max_pool2d(x, 2)),
                                       ("QuantAvgPool2d", lambda x: nn.functional.avg_pool2d(x, 2)),
                                       ("QuantAdaptiveAvgPool2d", lambda x: nn.functional.adaptive_avg_pool2d(x, 2))])
def test_pooling_quantizes_its_input(name, ref):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    pool = getattr(quant_nn, name)(2, quant_desc_input=QuantDescriptor(amax=1.5))
    torch.testing.assert_close(pool(x), ref(_fake_int8(x, torch.tensor(1.5))), rtol=0, atol=1e-6)
    assert pool._input_quantizer is pool.input_quantizer
    quant_nn.QuantAvgPool2d.set_default_quant_desc_input(QuantDescriptor(calib_method="histogram"))
    try:
        assert quant_nn.QuantAvgPool2d(2)._input_quantizer.histogram
        assert not quant_nn.QuantMaxPool2d(2)._input_quantizer.histogram  # per class, as in pytorch-quantization
    finally:
        del quant_nn.QuantAvgPool2d.default_quant_desc_input


def test_initialize_swaps_average_pools_and_takes_custom_entries():
    with quant_modules.enabled(float_module_list=["LSTM", "Linear"],
                               custom_quant_modules=[(torch.nn, "MaxPool2d", quant_nn.QuantMaxPool2d)]):
        avg, mx, fc = nn.AdaptiveAvgPool2d(1), nn.MaxPool2d(2), nn.Linear(2, 2)
    assert isinstance(avg, quant_nn.QuantAdaptiveAvgPool2d) and isinstance(mx, quant_nn.QuantMaxPool2d)
    assert type(fc) is nn.Linear and nn.MaxPool2d.__name__ == "MaxPool2d"
    with pytest.raises(AttributeError, match="recurrent layers"):
        quant_nn.QuantLSTM  # noqa: B018


def test_calibrators_built_directly_match_the_native_ones():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    from overdrive.quant.calibrators import HistogramCalibrator as NativeHist

    hist, native = calib.HistogramCalibrator(8, None, False), NativeHist()
    hist.collect(x)
    native.collect(x)
    for method, kw in (("percentile", {"percentile": 99.9}), ("mse", {}), ("entropy", {})):
        assert torch.equal(hist.compute_amax(method, **kw), native.compute_amax(method, kw.get("percentile")))
    mx = calib.MaxCalibrator(8, (0,), False)
    assert mx.compute_amax() is None
    mx.collect(x.view(64, 64))
    assert torch.equal(mx.compute_amax(), x.view(64, 64).abs().amax(dim=1))
    with pytest.raises(UsageError, match="per tensor"):
        calib.HistogramCalibrator(8, (0,), False)
    assert isinstance(quant_nn.QuantLinear(2, 2)._weight_quantizer._calibrator, calib.MaxCalibrator)


# --- custom quantized modules (pytorch-quantization's "Creating Custom Quantized Modules" tutorial) ---------------


class DocsQuantLinear(nn.Linear, quant_nn_utils.QuantMixin):
    """The tutorial's quantized Linear, as written there."""

    def __init__(self, in_features, out_features, bias=True, **kwargs):
        super().__init__(in_features, out_features, bias)
        quant_desc_input, quant_desc_weight = quant_nn_utils.pop_quant_desc_in_kwargs(self.__class__, **kwargs)
        self.init_quantizer(quant_desc_input, quant_desc_weight)

    def forward(self, input):
        return nn.functional.linear(self._input_quantizer(input), self._weight_quantizer(self.weight), bias=self.bias)

    @property
    def input_quantizer(self):
        return self._input_quantizer

    @property
    def weight_quantizer(self):
        return self._weight_quantizer


class DocsQuantMaxPool1d(nn.MaxPool1d, quant_nn_utils.QuantInputMixin):
    def __init__(self, kernel_size, **kwargs):
        super().__init__(kernel_size)
        self.init_quantizer(quant_nn_utils.pop_quant_desc_in_kwargs(self.__class__, input_only=True, **kwargs))

    def forward(self, input):
        return super().forward(self._input_quantizer(input))


def test_docs_custom_modules_calibrate_and_match_the_built_in_layer():
    torch.manual_seed(0)
    per_row = QuantDescriptor(axis=(0,))
    custom = nn.Sequential(DocsQuantLinear(8, 6, quant_desc_weight=per_row), DocsQuantMaxPool1d(2))
    builtin = nn.Sequential(quant_nn.QuantLinear(8, 6, quant_desc_weight=per_row), quant_nn.QuantMaxPool1d(2))
    builtin[0].load_state_dict(custom[0].state_dict())
    assert sorted(n for n, _ in custom.named_children()) == ["0", "1"]
    assert {n for n, _ in custom.named_modules() if "quantizer" in n} == {
        "0._input_quantizer", "0._weight_quantizer", "1._input_quantizer"}  # pytorch-quantization's names
    assert custom[0].input_quantizer is custom[0]._input_quantizer and custom[0]._fake_quant
    data = [(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)), None) for i in range(3)]
    with torch.no_grad():
        for model in (custom, builtin):  # the TensorRT samples' loop: weights calibrate on what forward passes them
            collect_stats(model, data, num_batches=len(data))
            compute_amax(model)
    w = custom[0].weight.detach()
    assert torch.equal(custom[0]._weight_quantizer.amax, w.abs().amax(1))  # per row, axis (0,)
    assert torch.equal(custom[0]._input_quantizer.amax, torch.stack([x.abs().max() for x, _ in data]).max())
    x = torch.randn(5, 8)
    with torch.no_grad():
        out = custom(x)
        assert torch.equal(out, builtin(x))
        # reference: float64 int8 fake quantization of input and per-row weight, then the same pool
        s_in = custom[0]._input_quantizer.amax.double() / 127
        s_w = (w.abs().amax(1, keepdim=True)).double() / 127
        xq = torch.clamp(torch.round(x.double() / s_in), -128, 127) * s_in
        wq = torch.clamp(torch.round(w.double() / s_w), -128, 127) * s_w
        h = nn.functional.linear(xq, wq, custom[0].bias.double())
        s_h = custom[1]._input_quantizer.amax.double() / 127
        ref = nn.functional.max_pool1d(torch.clamp(torch.round(h / s_h), -128, 127) * s_h, 2)
        assert torch.allclose(out.double(), ref, atol=1e-5)


def test_custom_module_calibrates_with_quant_calibrate():
    torch.manual_seed(0)
    layer = DocsQuantLinear(8, 4, quant_desc_weight=QuantDescriptor(axis=(0,)))
    quant.calibrate(layer, lambda m: m(torch.randn(16, 8)))  # its own weight quantizer too (it sees the weight)
    assert torch.equal(layer._weight_quantizer.amax, layer.weight.detach().abs().amax(1))
    assert layer._input_quantizer.is_calibrated


def test_mixins_cover_built_in_layers_and_transfer_pattern():
    """The YOLO / PointPillars QAT scripts' ``transfer_torch_to_quantization``: QuantConv2d.__new__, the float
    layer's attributes copied, then a nested ``__init__`` that calls init_quantizer by mixin kind."""
    assert isinstance(quant_nn.QuantConv2d(3, 4, 3), quant_nn_utils.QuantMixin)
    assert isinstance(quant_nn.QuantMaxPool2d(2), quant_nn_utils.QuantInputMixin)
    assert not isinstance(quant_nn.QuantMaxPool2d(2), quant_nn_utils.QuantMixin)
    assert isinstance(quant.quantize(nn.Linear(4, 4), quant.INT8_DEFAULT), quant_nn_utils.QuantMixin)

    def transfer(module, quant_cls):
        inst = quant_cls.__new__(quant_cls)
        for k, v in vars(module).items():
            setattr(inst, k, v)

        def __init__(self):  # noqa: N807 - as written in those scripts
            if isinstance(self, quant_nn_utils.QuantInputMixin):
                self.init_quantizer(quant_nn_utils.pop_quant_desc_in_kwargs(self.__class__, input_only=True))
            else:
                self.init_quantizer(*quant_nn_utils.pop_quant_desc_in_kwargs(self.__class__))
                if isinstance(self._input_quantizer._calibrator, calib.HistogramCalibrator):
                    self._input_quantizer._calibrator._torch_hist = True

        __init__(inst)
        return inst

    mapping = {id(getattr(e.orig_mod, e.mod_name)): e.replace_mod for e in quant_modules._DEFAULT_QUANT_MAP}
    torch.manual_seed(0)
    conv, pool = nn.Conv2d(3, 4, 3), nn.AvgPool2d(2)
    float_conv = copy.deepcopy(conv)  # transfer shares conv's _modules dict, so conv gets the quantizers too
    qconv = transfer(conv, mapping[id(type(conv))])
    qpool = transfer(pool, mapping[id(type(pool))])
    assert type(qconv) is quant_nn.QuantConv2d and type(qpool) is quant_nn.QuantAvgPool2d
    assert qconv.weight is conv.weight and tuple(qconv._weight_quantizer.axis) == (0,)
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(qconv, qpool)
    quant.calibrate(model, lambda m: m(x))
    native = quant.quantize(nn.Sequential(float_conv, nn.AvgPool2d(2)), quant.INT8_DEFAULT, lambda m: m(x))
    assert torch.equal(qconv.weight_quantizer.amax, native[0].weight_quantizer.amax)
    assert torch.equal(qconv.input_quantizer.amax, native[0].input_quantizer.amax)


def test_pop_quant_desc_refuses_unknown_keywords():
    with pytest.raises(UsageError, match="quant_desc_wieght"):
        quant_nn_utils.pop_quant_desc_in_kwargs(DocsQuantLinear, quant_desc_wieght=QuantDescriptor())
    with pytest.raises(UsageError, match="QuantDescriptor"):
        DocsQuantLinear(4, 4, quant_desc_input="int8")


@pytest.mark.parametrize("dims", [1, 3])
def test_conv_transpose_1d_3d(dims):
    torch.manual_seed(0)
    cls = getattr(quant_nn, f"QuantConvTranspose{dims}d")
    layer = cls(4, 6, 3, stride=2)
    x = torch.randn(2, 4, *([5] * dims))
    quant.calibrate(layer, lambda m: m(x))
    w = layer.weight.detach()
    amax_w = w.abs().amax(dim=[d for d in range(w.dim()) if d != 1])  # per output channel: axis 1
    assert torch.equal(layer.weight_quantizer.amax, amax_w)
    s_w = (amax_w / 127).double().view(1, -1, *([1] * dims))
    s_x = x.abs().max().double() / 127
    ref = getattr(nn.functional, f"conv_transpose{dims}d")(
        torch.clamp(torch.round(x.double() / s_x), -128, 127) * s_x,
        torch.clamp(torch.round(w.double() / s_w), -128, 127) * s_w, layer.bias.double(), stride=2)
    with torch.no_grad():
        assert torch.allclose(layer(x).double(), ref, atol=1e-5)
    with quant_modules.enabled():
        built = getattr(nn, f"ConvTranspose{dims}d")(4, 6, 3)
    assert type(built) is cls
    with pytest.raises(UsageError, match="groups=2"):
        cls(4, 4, 3, groups=2)


def test_an_uncalibrated_layer_quantizes_with_the_tensors_own_max() -> None:
    """The docs' "quantizing by hand": ``QuantLinear(16, 32)(x)`` with no calibration raised "is not calibrated";
    pytorch-quantization takes amax from the tensor it quantizes (per tensor for the input, per output row for the
    weight). Reference: that rule written out."""
    torch.manual_seed(0)
    fc = quant_nn.QuantLinear(16, 32)
    x = torch.randn(4, 16) * 3
    w_amax = fc.weight.detach().abs().amax(dim=1, keepdim=True)
    ref = torch.nn.functional.linear(_fake_int8(x, x.abs().max()), _fake_int8(fc.weight.detach(), w_amax), fc.bias)
    torch.testing.assert_close(fc(x), ref, atol=1e-5, rtol=1e-5)
    assert fc._input_quantizer.amax is None  # nothing stored: the next tensor uses its own max
    fc._input_quantizer.set_amax(torch.tensor(1.0))  # a calibrated quantizer clips at its amax, as before
    assert float(fc(x).sub(ref).abs().max()) > 0.1


def test_load_calib_amax_strict_false_skips_a_quantizer_that_saw_no_data() -> None:
    """YOLOv7's QAT recipe calls ``module.load_calib_amax(strict=False)`` (TypeError before); a quantizer whose layer
    the calibration never ran warns and keeps its amax with strict=False, and raises with strict=True."""
    q = quant_nn.TensorQuantizer(QuantDescriptor(calib_method="histogram"))
    q.disable_quant()
    q.enable_calib()
    with pytest.warns(RuntimeWarning, match="saw no data"):
        q.load_calib_amax(strict=False)
    assert q.amax is None
    with pytest.raises(UsageError, match="saw no data"):
        q.load_calib_amax()
    q(torch.randn(64) * 2)
    q.load_calib_amax("percentile", percentile=99.9, strict=False)
    assert q.amax is not None and 0 < float(q.amax) <= float(q.calibrator.compute_amax("max"))
    with pytest.raises(UsageError, match="unexpected keyword"):
        q.load_calib_amax(method="max", nonsense=1)


def test_assigning_a_layers_input_quantizer_shares_it() -> None:
    """YOLOv7's rules: ``b._input_quantizer = a._input_quantizer`` (one scale for a concat's inputs). The assignment
    went to a third module the layer never ran, silently. Now both layers run the one quantizer."""
    a, b = quant_nn.QuantConv2d(3, 4, 3), quant_nn.QuantConv2d(3, 4, 3)
    b._input_quantizer = a._input_quantizer
    assert b._input_quantizer is a._input_quantizer and b.input_quantizer is a.input_quantizer
    assert [n for n, _ in b.named_children()] == ["input_quantizer", "weight_quantizer"]
    a._input_quantizer.set_amax(torch.tensor(0.5))
    x = torch.randn(1, 3, 6, 6)
    ref = torch.nn.functional.conv2d(_fake_int8(x, torch.tensor(0.5)), b._weight_quantizer(b.weight), b.bias)
    torch.testing.assert_close(b(x), ref, atol=1e-5, rtol=1e-5)
    pool = quant_nn.QuantMaxPool2d(2)
    pool._input_quantizer = a._input_quantizer
    assert pool.input_quantizer is a._input_quantizer
