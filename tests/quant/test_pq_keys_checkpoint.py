"""Checkpoint key names of the pytorch-quantization face: its layers save ``<layer>._input_quantizer._amax`` /
``<layer>._weight_quantizer._amax`` (per-channel amax in keep-dims shape), as pytorch-quantization does, and load
that form or overdrive.quant's native ``<layer>.input_quantizer.amax``; natively quantized models keep theirs."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from overdrive import quant
from overdrive.quant.pytorch_quantization import nn as quant_nn
from overdrive.quant.pytorch_quantization import quant_modules
from overdrive.quant.pytorch_quantization.nn.modules import _utils as quant_nn_utils


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=2)
        self.fc = nn.Linear(2 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.up(self.pool(torch.relu(self.conv(x)))).flatten(1))


DATA = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
TEST = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(99))
# pytorch-quantization's keys and amax shapes for Net (weights per output channel: axis 0, ConvTranspose axis 1)
ORIGINAL_SHAPES = {
    "conv._input_quantizer._amax": (), "conv._weight_quantizer._amax": (4, 1, 1, 1),
    "pool._input_quantizer._amax": (),
    "up._input_quantizer._amax": (), "up._weight_quantizer._amax": (1, 2, 1, 1),
    "fc._input_quantizer._amax": (), "fc._weight_quantizer._amax": (5, 1),
}


def face_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with quant_modules.enabled():
        return Net().eval()


def calibrated_face_model() -> nn.Module:
    model = face_model()
    quant.calibrate(model, lambda m: [m(x) for x in DATA])
    return model


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_face_state_dict_has_the_original_keys_and_keepdims_shapes() -> None:
    model = calibrated_face_model()
    sd = model.state_dict()
    quant_keys = {k: tuple(v.shape) for k, v in sd.items() if "quantizer" in k}
    assert quant_keys == ORIGINAL_SHAPES
    # a ported script indexes the original's key
    assert torch.equal(sd["fc._input_quantizer._amax"], model.fc._input_quantizer.amax)
    assert torch.equal(sd["conv._weight_quantizer._amax"].flatten(), model.conv.weight_quantizer.amax)
    # the layer's own keys keep their order: weight, bias, then the quantizers
    assert [k for k in sd if k.startswith("fc.")] == ["fc.weight", "fc.bias", "fc._input_quantizer._amax",
                                                      "fc._weight_quantizer._amax"]
    # attribute access as in pytorch-quantization: the same quantizer objects, also when assigned
    assert model.fc._input_quantizer is model.fc.input_quantizer
    model.fc._input_quantizer = model.up._input_quantizer
    assert model.fc.input_quantizer is model.up.input_quantizer


def test_face_checkpoint_roundtrip_into_a_fresh_face_model() -> None:
    model = calibrated_face_model()
    fresh = face_model(seed=1)  # other weights, uncalibrated: everything comes from the file
    fresh.load_state_dict(roundtrip(model.state_dict()))  # strict
    with torch.no_grad():
        assert torch.equal(fresh(TEST), model(TEST))
    assert fresh.conv.weight_quantizer.amax.shape == (4,)  # kept flat inside, keep-dims only in the file
    assert {k: tuple(v.shape) for k, v in fresh.state_dict().items() if "quantizer" in k} == ORIGINAL_SHAPES


def test_hand_written_original_checkpoint_loads_and_saves_back_unchanged() -> None:
    reference = face_model(seed=3)
    original = {k: v.clone() for k, v in reference.state_dict().items()}  # float weights only (uncalibrated)
    gen = torch.Generator().manual_seed(5)
    for key, shape in ORIGINAL_SHAPES.items():  # what pytorch-quantization writes, by hand
        original[key] = torch.rand(shape, generator=gen) + 0.5
    model = face_model()
    model.load_state_dict(original)  # strict
    assert torch.equal(model.fc.input_quantizer.amax, original["fc._input_quantizer._amax"])
    assert torch.equal(model.up.weight_quantizer.amax, original["up._weight_quantizer._amax"].flatten())
    # saved back: the same keys, shapes and values, so pytorch-quantization / TensorRT tooling reads it
    saved = model.state_dict()
    assert set(saved) == set(original)
    assert all(torch.equal(saved[k], v) for k, v in original.items())


def test_face_checkpoint_loads_into_a_native_model_and_native_keys_stay() -> None:
    model = calibrated_face_model()
    torch.manual_seed(0)
    native = quant.quantize(Net().eval(), quant.QuantConfig(residual_add=False), lambda m: [m(x) for x in DATA[:1]])
    native_keys = {k for k in native.state_dict() if "quantizer" in k}
    assert "fc.input_quantizer.amax" in native_keys and not any("_amax" in k for k in native_keys)
    result = native.load_state_dict(roundtrip(model.state_dict()), strict=False)
    assert not result.missing_keys and set(result.unexpected_keys) <= {"pool._input_quantizer._amax"}
    assert torch.equal(native.conv.weight_quantizer.amax, model.conv.weight_quantizer.amax)
    assert torch.equal(native.fc.input_quantizer.amax, model.fc.input_quantizer.amax)
    # and the native form loads into the face model
    back = face_model(seed=2)
    back.load_state_dict({**back.state_dict(), **native.state_dict()}, strict=False)
    assert torch.equal(back.up.weight_quantizer.amax, native.up.weight_quantizer.amax)


def test_native_keys_load_into_a_face_model_strictly() -> None:
    model = calibrated_face_model()
    native_form = {}
    for k, v in model.state_dict().items():  # overdrive's own form: input_quantizer.amax, (C,) amax
        if k.endswith("quantizer._amax"):
            k, v = k.replace("._input_quantizer._amax", ".input_quantizer.amax").replace(
                "._weight_quantizer._amax", ".weight_quantizer.amax"), v.flatten() if v.dim() else v
        native_form[k] = v
    fresh = face_model(seed=4)
    fresh.load_state_dict(native_form)  # strict
    with torch.no_grad():
        assert torch.equal(fresh(TEST), model(TEST))


class DocsQuantLinear(nn.Linear, quant_nn_utils.QuantMixin):
    def __init__(self, in_features: int, out_features: int, **kwargs) -> None:
        super().__init__(in_features, out_features)
        self.init_quantizer(*quant_nn_utils.pop_quant_desc_in_kwargs(self.__class__, **kwargs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self._input_quantizer(x), self._weight_quantizer(self.weight), self.bias)


def test_custom_quant_mixin_module_and_hand_built_layer_save_original_keys() -> None:
    from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

    torch.manual_seed(0)
    layer = DocsQuantLinear(6, 3, quant_desc_weight=QuantDescriptor(axis=(0,)))
    layer._input_quantizer.amax = torch.tensor(2.0)
    layer._weight_quantizer.amax = layer.weight.detach().abs().amax(1)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {
        "weight": (3, 6), "bias": (3,), "_input_quantizer._amax": (), "_weight_quantizer._amax": (3, 1)}
    # YOLO's QAT recipe: QuantConv2d.__new__ + the float conv's __dict__ + init_quantizer
    conv = nn.Conv2d(3, 2, 3)
    qconv = quant_nn.QuantConv2d.__new__(quant_nn.QuantConv2d)
    qconv.__dict__.update(conv.__dict__)
    qconv.init_quantizer(quant_nn.QuantConv2d.default_quant_desc_input, quant_nn.QuantConv2d.default_quant_desc_weight)
    qconv.weight_quantizer.amax = torch.ones(2)
    assert {k: tuple(v.shape) for k, v in qconv.state_dict().items() if "quantizer" in k} == {
        "_weight_quantizer._amax": (2, 1, 1, 1)}


@pytest.mark.parametrize("trace", ["jit", "keep_vars"])
def test_keep_vars_and_tracing_see_the_buffers_themselves(trace: str) -> None:
    model = calibrated_face_model()
    if trace == "keep_vars":  # torch.jit / torch.onnx map these values back to the module's tensors by identity
        sd = model.state_dict(keep_vars=True)
        assert sd["conv._weight_quantizer._amax"] is model.conv.weight_quantizer.amax
        assert sd["fc._input_quantizer._amax"] is model.fc.input_quantizer.amax
    else:
        with torch.no_grad():
            traced = torch.jit.trace(model, TEST)
            assert torch.equal(traced(TEST), model(TEST))
