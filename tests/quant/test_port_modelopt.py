"""ModelOpt scripts with only the import changed (issue 20), checked against the native overdrive.quant path.

Each test is written as a ModelOpt user script (the shape of ModelOpt's PTQ docs: deep-copy a preset, edit
its wildcard patterns, ``mtq.quantize(model, config, forward_loop)``, ``mto.save`` / ``mto.restore``) and
compares amax and outputs with ``quant.quantize`` under the matching QuantConfig. Tolerance: exact equality
(the same quantizers see the same tensors, so there is nothing to round differently).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import overdrive.quant.modelopt as mtq  # was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt.opt as mto  # was: import modelopt.torch.opt as mto
from overdrive import quant
from overdrive._utils.errors import UsageError


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.blocks(self.embed(ids)))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().eval()


CALIB = [torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(i)) for i in range(4)]
TEST = torch.randint(0, 32, (3, 12), generator=torch.Generator().manual_seed(99))


def forward_loop(model: nn.Module) -> None:
    for batch in CALIB:
        model(batch)


def amaxes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.amax for n, q in quant.quantizers(model) if q.enabled}


def assert_same(ported: nn.Module, native: nn.Module) -> None:
    a, b = amaxes(ported), amaxes(native)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    with torch.no_grad():
        assert torch.equal(ported(TEST), native(TEST))


def test_int8_script_with_edited_patterns_matches_native(capsys):
    model = make_model()
    native = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT.replace(
        residual_add=False, exclude=("lm_head", "blocks.1.fc2")), forward_loop)

    # --- the ModelOpt script ---
    config = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    config["quant_cfg"]["*blocks.1.fc2*"] = {"enable": False}  # keep a sensitive layer in float
    model = mtq.quantize(model, config, forward_loop)
    mtq.print_quant_summary(model)
    # ---
    out = capsys.readouterr().out
    assert "blocks.0.fc1.input_quantizer" in out and "10 TensorQuantizers found in model" in out
    assert not model.lm_head.input_quantizer.enabled and not model.blocks[1].fc2.weight_quantizer.enabled
    assert_same(model, native)


def test_the_literal_dict_config_of_the_docs_runs():
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0},
                         "*input_quantizer": {"num_bits": 8, "axis": None},
                         "*lm_head*": {"enable": False}, "default": {"enable": False}},
           "algorithm": "max"}
    model = mtq.quantize(make_model(), cfg, forward_loop)
    native = quant.quantize(make_model(), quant.INT8_DEFAULT.replace(residual_add=False, exclude=("lm_head",)),
                            forward_loop)
    assert_same(model, native)


def test_fp8_script_matches_native_per_tensor_fp8():
    model = mtq.quantize(make_model(), mtq.FP8_DEFAULT_CFG, forward_loop)
    fp8_per_tensor = quant.QuantConfig(input=quant.QuantizerConfig(format="fp8_e4m3"),
                                       weight=quant.QuantizerConfig(format="fp8_e4m3"),
                                       residual_add=False, exclude=("lm_head",))
    native = quant.quantize(make_model(), fp8_per_tensor, forward_loop)
    assert model.blocks[0].fc1.weight_quantizer.amax.dim() == 0  # ModelOpt's fp8 preset: per-tensor weights
    assert_same(model, native)


def test_disable_and_enable_quantizer_by_pattern():
    model = mtq.quantize(make_model(), mtq.INT8_DEFAULT_CFG, forward_loop)
    native = quant.quantize(make_model(), quant.INT8_DEFAULT.replace(residual_add=False, exclude=("lm_head",)),
                            forward_loop)
    mtq.disable_quantizer(model, "*fc1.input_quantizer")
    assert [n for n, q in quant.quantizers(model) if n.endswith("fc1.input_quantizer") and q.enabled] == []
    native.blocks[0].fc1.input_quantizer.enabled = native.blocks[1].fc1.input_quantizer.enabled = False
    with torch.no_grad():
        assert torch.equal(model(TEST), native(TEST))
    mtq.enable_quantizer(model, lambda name: name.endswith("fc1.input_quantizer"))
    native.blocks[0].fc1.input_quantizer.enabled = native.blocks[1].fc1.input_quantizer.enabled = True
    assert_same(model, native)


def test_save_and_restore_on_a_fresh_model(tmp_path):
    model = mtq.quantize(make_model(), mtq.INT8_DEFAULT_CFG, forward_loop)
    mto.save(model, tmp_path / "modelopt_quantized.pth")

    restored = mto.restore(make_model(seed=1), tmp_path / "modelopt_quantized.pth")  # other weights: all replaced
    assert_same(restored, model)
    assert not restored.lm_head.input_quantizer.enabled
    ckpt = torch.load(tmp_path / "modelopt_quantized.pth", weights_only=True)
    assert ckpt["modelopt_state"] == mto.modelopt_state(model)


def test_save_and_restore_a_natively_quantized_model_with_residual_adds(tmp_path):
    native = quant.quantize(make_model(), quant.INT8_DEFAULT, forward_loop)
    assert any(n.endswith("residual_quantizer") for n, _ in quant.quantizers(native))
    mto.save(native, tmp_path / "m.pth")
    assert_same(mto.restore(make_model(seed=3), tmp_path / "m.pth"), native)


def test_presets_are_read_only_and_copies_are_editable():
    """Both edit styles are refused on the preset itself (one script must not change it for the next) and work
    on a deep copy: a plain dict whose quant_cfg is an editable list of plain dict entries."""
    with pytest.raises(UsageError, match="deepcopy"):
        mtq.INT8_DEFAULT_CFG["quant_cfg"]["*lm_head*"] = {"enable": True}
    with pytest.raises(UsageError, match="deepcopy"):
        mtq.INT8_DEFAULT_CFG["quant_cfg"].append({"quantizer_name": "*lm_head*", "enable": True})
    with pytest.raises(UsageError, match="deepcopy"):
        mtq.INT8_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"]["axis"] = None
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    assert type(cfg) is dict and type(cfg["quant_cfg"]) is mtq.QuantCfgList
    assert all(type(e) is dict for e in cfg["quant_cfg"])
    cfg["quant_cfg"].append({"quantizer_name": "*lm_head*", "enable": True})
    cfg["quant_cfg"]["*weight_quantizer"]["axis"] = None
    assert mtq.INT8_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"] == {"num_bits": 8, "axis": 0}
    assert len(mtq.INT8_DEFAULT_CFG["quant_cfg"]) == len(cfg["quant_cfg"]) - 1


def test_smoothquant_config_matches_the_native_smoothquant():
    native = quant.quantize(make_model(), quant.INT8_SMOOTHQUANT.replace(  # ModelOpt: [-128, 127], lm_head float,
        residual_add=False, weight=quant.QuantizerConfig(per_channel=True), exclude=("*lm_head*",),
        smoothquant=1.0), forward_loop)  # and "smoothquant" without alpha is ModelOpt's default alpha, 1.0
    ported = mtq.quantize(make_model(), mtq.INT8_SMOOTHQUANT_CFG, forward_loop)
    smoothed = {n: q.pre_quant_scale for n, q in quant.quantizers(ported) if q.pre_quant_scale is not None}
    assert smoothed and smoothed.keys() == {n for n, q in quant.quantizers(native) if q.pre_quant_scale is not None}
    for n, q in quant.quantizers(native):
        if n in smoothed:
            torch.testing.assert_close(smoothed[n], q.pre_quant_scale)
    assert amaxes(ported).keys() <= amaxes(native).keys()
    for n, a in amaxes(ported).items():
        torch.testing.assert_close(a, amaxes(native)[n])
    cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    cfg["algorithm"] = {"method": "smoothquant", "alpha": 1.5}
    with pytest.raises(UsageError, match=r"alpha=1.5 must be a number in \[0, 1\]"):
        mtq.quantize(make_model(), cfg, forward_loop)


def test_unsupported_attributes_teach():
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*input_quantizer"]["axis"] = -1
    with pytest.raises(UsageError, match="per tensor"):
        mtq.quantize(make_model(), cfg, forward_loop)
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*weight_quantizer"] = {"num_bits": 4, "block_sizes": {-1: 128}}
    model = make_model()
    with pytest.raises(UsageError, match="weight_only"):
        mtq.quantize(model, cfg, forward_loop)
    assert type(model.lm_head) is nn.Linear  # refused before the model was touched


def test_weight_only_int8_preset_quantizes_weights_only():
    """mtq.INT8_WEIGHT_ONLY_CFG: every Linear but lm_head gets an int8 per-channel weight quantizer, no activation
    quantizer; the output is the float model's with the weights rounded to int8 (reference: the weights
    fake-quantized by hand, per output channel, amax / 127)."""
    model = mtq.quantize(make_model(), mtq.INT8_WEIGHT_ONLY_CFG, forward_loop)
    on = {n for n, q in quant.quantizers(model) if q.enabled}
    assert on and all(n.endswith("weight_quantizer") and "lm_head" not in n for n in on)
    ref = make_model()
    with torch.no_grad():
        for blk in ref.blocks:
            for fc in (blk.fc1, blk.fc2):
                s = fc.weight.abs().amax(dim=1, keepdim=True) / 127
                fc.weight.copy_((fc.weight / s).round().clamp(-127, 127) * s)
        assert torch.allclose(model(TEST), ref(TEST), atol=1e-5)


def test_presets_the_port_lacks_say_what_to_use():
    """mtq.INT4_AWQ_CFG, mtq.NVFP4_DEFAULT_CFG and the KV-cache presets: a one-line error naming the preset and the
    alternative (was a bare AttributeError); hasattr stays False for them."""
    with pytest.raises(UsageError, match=r"mtq\.INT4_AWQ_CFG .*weight_only\(model, bits=4"):
        mtq.INT4_AWQ_CFG  # noqa: B018
    with pytest.raises(AttributeError, match="FP8_DEFAULT_CFG"):
        mtq.NVFP4_DEFAULT_CFG  # noqa: B018
    assert not hasattr(mtq, "FP8_KV_CFG") and getattr(mtq, "W4A8_AWQ_BETA_CFG", None) is None
    with pytest.raises(AttributeError, match="no attribute 'NOT_A_PRESET'"):
        mtq.NOT_A_PRESET  # noqa: B018


def test_set_quantizer_by_cfg_leaves_unmatched_quantizers_as_they_are():
    """ModelOpt applies only the entries given; every other quantizer keeps its format and amax (this call used
    to reset them all to uncalibrated int8)."""
    model = mtq.quantize(make_model(), mtq.FP8_DEFAULT_CFG, forward_loop)
    before = amaxes(model)
    mtq.set_quantizer_by_cfg(model, {"*blocks.0.fc1*": {"enable": False}})
    assert not model.blocks[0].fc1.input_quantizer.enabled
    after = amaxes(model)
    assert set(after) == set(before) - {"blocks.0.fc1.input_quantizer", "blocks.0.fc1.weight_quantizer"}
    assert all(torch.equal(after[n], before[n]) for n in after)
    assert model.blocks[1].fc2.weight_quantizer.config.format == "fp8_e4m3"


def test_set_quantizer_attribute_by_pattern_function_and_parent_class():
    model = mtq.quantize(make_model(), mtq.INT8_DEFAULT_CFG, forward_loop)
    mtq.set_quantizer_attribute(model, "*", {"enable": False})
    with torch.no_grad():
        torch.testing.assert_close(model(TEST), make_model()(TEST), rtol=0, atol=0)  # every quantizer off: float
    mtq.set_quantizer_attribute(model, lambda n: n.endswith("input_quantizer"), {"enable": True})
    assert model.blocks[0].fc1.input_quantizer.enabled and not model.blocks[0].fc1.weight_quantizer.enabled
    # a change of axis: the weight is per tensor now, recalibrated by mtq.calibrate from the weight
    mtq.set_quantizer_attribute(model, "*weight_quantizer", {"enable": True, "axis": None}, parent_class=nn.Linear)
    q = model.lm_head.weight_quantizer
    assert q.axis is None and q.amax is None
    mtq.calibrate(model, "max", forward_loop)
    assert torch.equal(q.amax, model.lm_head.weight.detach().abs().max())


def test_postprocess_amax_and_forward_loop_without_arguments():
    model = make_model()
    with pytest.warns(DeprecationWarning, match="take the model"):
        model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda: forward_loop(model))
    before = amaxes(model)
    floor = 2 * float(model.blocks[0].fc1.input_quantizer.amax)
    model = mtq.postprocess_amax(model, "*fc1.input_quantizer", lambda amax: torch.clamp(amax, min=floor))
    for name, amax in amaxes(model).items():
        expected = before[name].clamp(min=floor) if name.endswith("fc1.input_quantizer") else before[name]
        assert torch.equal(amax, expected), name


@pytest.mark.parametrize("cfg", ["INT8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "FP8_DEFAULT_CFG"])
def test_fold_weight_keeps_the_outputs(cfg):
    model = mtq.quantize(make_model(), getattr(mtq, cfg), forward_loop)
    with torch.no_grad():
        before = model(TEST)
        mtq.fold_weight(model)
        after = model(TEST)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    assert not any(q.is_enabled for n, q in quant.quantizers(model) if n.endswith("weight_quantizer"))
    w = model.blocks[0].fc1.weight.detach()
    q = model.blocks[0].fc1.weight_quantizer
    assert q.pre_quant_scale is None
    if cfg == "INT8_DEFAULT_CFG":  # the folded weight lies on the int8 grid of its row
        steps = w / (q.amax.view(-1, 1) / 127)
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)


def test_modelopt_nn_tensor_quantizer_finds_every_quantizer():
    from overdrive.quant.modelopt.nn import TensorQuantizer

    model = mtq.quantize(make_model(), mtq.INT8_DEFAULT_CFG, forward_loop)
    found = [n for n, m in model.named_modules() if isinstance(m, TensorQuantizer)]
    assert found == [n for n, _ in quant.quantizers(model)] and len(found) == 10
    assert mtq.nn.TensorQuantizer is TensorQuantizer


# --- mtq.register: custom quantized classes (ModelOpt's conversion.register docs) --------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class QuantRMSNorm(RMSNorm):
    def _setup(self) -> None:
        self.input_quantizer = mtq.nn.TensorQuantizer()
        self.weight_quantizer = mtq.nn.TensorQuantizer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_quantizer(x)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight_quantizer(self.weight)


class Normed(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm, self.fc = RMSNorm(d), nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


@pytest.fixture
def registered_rmsnorm():
    mtq.register(original_cls=RMSNorm, quantized_cls=QuantRMSNorm)
    yield
    mtq.unregister(RMSNorm)


def _fake_quant_ref(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """int8 symmetric fake quantization in float64: round(x / s) clamped to [-128, 127], s = amax / 127."""
    s = amax.double() / 127
    return (torch.clamp(torch.round(x.double() / s), -128, 127) * s).float()


def test_register_quantizes_and_calibrates_a_custom_module(registered_rmsnorm):
    torch.manual_seed(0)
    model, x = Normed(), torch.randn(64, 8)
    original_norm = model.norm
    ref = copy.deepcopy(model)
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop=lambda m: m(x))
    norm = model.norm
    assert type(norm) is QuantRMSNorm and type(original_norm) is RMSNorm  # the original object is not changed
    assert norm.weight is original_norm.weight  # parameters shared, as for the built-in layers
    # *weight_quantizer {"axis": 0}: one amax per element of the (C,) weight; input: per tensor, max |x|
    assert torch.equal(norm.weight_quantizer.amax, norm.weight.detach().abs())
    assert torch.equal(norm.input_quantizer.amax, x.abs().max())
    assert "norm" not in model._overdrive_quant["skipped"]
    # numerics: the registered forward against a float64 fake-quant reference of the same formula
    xq = _fake_quant_ref(x, x.abs().max())
    w = ref.norm.weight.detach()
    wq = (torch.round(w.double() / (w.abs().double() / 127)) * (w.abs().double() / 127)).float()  # per element
    expected = xq * torch.rsqrt(xq.pow(2).mean(-1, keepdim=True) + 1e-6) * wq
    assert torch.allclose(norm(x), expected, atol=1e-5)
    # the patterns reach it like a built-in layer's quantizers
    mtq.disable_quantizer(model, "*norm.input_quantizer")
    assert not norm.input_quantizer.enabled and model.fc.input_quantizer.enabled


def test_register_without_subclassing_and_overriding_linear():
    class QuantLinearOwn(nn.Module):  # a quantized class that does not subclass the original (ModelOpt allows it)
        def _setup(self) -> None:
            self.input_quantizer = mtq.nn.TensorQuantizer()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.input_quantizer(x), self.weight, self.bias)

    mtq.register(original_cls=nn.Linear, quantized_cls=QuantLinearOwn)
    try:
        x = torch.randn(16, 8)
        model = mtq.quantize(nn.Sequential(nn.Linear(8, 4)), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    finally:
        mtq.unregister(nn.Linear)
    layer = model[0]
    assert isinstance(layer, QuantLinearOwn) and isinstance(layer, nn.Linear)  # made from both, as ModelOpt
    assert not hasattr(layer, "weight_quantizer")  # the registered class replaced the built-in QuantLinear
    assert torch.allclose(layer(x), nn.functional.linear(_fake_quant_ref(x, x.abs().max()), layer.weight, layer.bias))
    plain = mtq.quantize(nn.Sequential(nn.Linear(8, 4)), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    assert type(plain[0]).__name__ == "QuantLinear"  # unregistered: the built-in class again


def test_register_checks_and_registry_api():
    class NoSetup(RMSNorm):
        pass

    with pytest.raises(UsageError, match="_setup"):
        mtq.register(original_cls=RMSNorm, quantized_cls=NoSetup)
    with pytest.raises(UsageError, match="not registered"):
        mtq.unregister(RMSNorm)
    reg = mtq.nn.QuantModuleRegistry
    reg.register({RMSNorm: "RMSNorm"})(QuantRMSNorm)  # ModelOpt's decorator form
    try:
        assert RMSNorm in reg and reg["RMSNorm"] is QuantRMSNorm and reg.get(nn.ReLU) is None
        with pytest.raises(UsageError, match="registered already"):
            mtq.register(original_cls=RMSNorm, quantized_cls=QuantRMSNorm)
    finally:
        mtq.unregister(RMSNorm)
    assert RMSNorm not in reg


def test_registered_module_saves_and_restores(registered_rmsnorm, tmp_path):
    torch.manual_seed(1)
    x = torch.randn(32, 8)
    model = mtq.quantize(Normed(), mtq.INT8_DEFAULT_CFG, forward_loop=lambda m: m(x))
    mto.save(model, tmp_path / "m.pth")
    fresh = Normed()
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "quantizer" not in k})
    restored = mto.restore(fresh, tmp_path / "m.pth")
    assert type(restored.norm) is QuantRMSNorm
    assert torch.equal(restored.norm.weight_quantizer.amax, model.norm.weight_quantizer.amax)
    assert torch.equal(restored(x), model(x))


@pytest.mark.parametrize("name", ["export", "compress", "auto_quantize"])
def test_missing_functions_name_the_alternative(name):
    with pytest.raises(AttributeError, match="quant\\."):
        getattr(mtq, name)
    assert not hasattr(mtq, name)


def test_modelopt_utils_export_torch_mode_and_is_quantized() -> None:
    """``from modelopt.torch.quantization.utils import export_torch_mode, is_quantized`` (Torch-TensorRT's PTQ
    examples) raised ModuleNotFoundError. The exported program computes what the quantized model computes."""
    import overdrive.quant.modelopt as mtq_
    from overdrive.quant.modelopt.utils import export_torch_mode, is_quantized, is_quantized_layer_with_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    model = mtq_.quantize(model, mtq_.INT8_DEFAULT_CFG, lambda m: m(torch.randn(32, 8)))
    x = torch.randn(5, 8)
    with export_torch_mode():
        ep = torch.export.export(model, (x,))
    torch.testing.assert_close(ep.module()(x), model(x), atol=1e-5, rtol=1e-5)
    assert is_quantized(model) and not is_quantized(torch.nn.Linear(2, 2))
    assert is_quantized_layer_with_weight(model[0]) and not is_quantized_layer_with_weight(model[1])


def test_enable_huggingface_checkpointing_round_trips_a_quantized_model(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """``mto.enable_huggingface_checkpointing()`` (ModelOpt's hf_ptq / llm_qat examples) raised AttributeError. Now
    ``save_pretrained`` of a quantized GPT-2 and ``AutoModelForCausalLM.from_pretrained`` give back a quantized model
    computing what the saved one computed (exactly: same weights, same amax); a float folder still loads float."""
    transformers = pytest.importorskip("transformers")
    base = transformers.PreTrainedModel
    for attr in ("save_pretrained", "from_pretrained"):  # put transformers back as it was after this test
        monkeypatch.setattr(base, attr, base.__dict__[attr])
    monkeypatch.setattr(base, "_overdrive_modelopt_checkpointing", False, raising=False)
    from overdrive.quant.modelopt.utils import is_quantized

    mto.enable_huggingface_checkpointing()
    mto.enable_huggingface_checkpointing()  # twice: wrapped once
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path / "float")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, forward_loop=lambda m: m(ids))
    model.save_pretrained(tmp_path / "q")
    assert (tmp_path / "q" / "modelopt_state.pth").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert is_quantized(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert not is_quantized(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float"))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.mark.parametrize("direction", ["disabled after quantize", "enabled after quantize"])
def test_mto_save_restore_keeps_quantizers_switched_after_quantize(direction: str, tmp_path) -> None:
    """Before: modelopt_state wrote each quantizer's config, whose ``enabled`` the switches after quantize do not
    change: the restored model had the config's on/off state, and other outputs (0.0055 here)."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    if direction == "disabled after quantize":
        m = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
        mtq.disable_quantizer(m, "2.*")
    else:
        cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
        cfg["quant_cfg"]["*2.input_quantizer"] = {"enable": False}
        m = mtq.quantize(_mlp(), cfg, lambda m: m(x))
        mtq.enable_quantizer(m, "2.input_quantizer")
        mtq.calibrate(m, forward_loop=lambda m: m(x))
    mto.save(m, tmp_path / "q.pth")
    r = mto.restore(_mlp(), tmp_path / "q.pth")
    for (n, a), (_, b) in zip(quant.quantizers(m), quant.quantizers(r)):
        assert a.enabled == b.enabled, n
    assert torch.equal(m(x), r(x))


def test_fold_weight_leaves_a_tied_weight_unfolded_and_the_outputs_unchanged() -> None:
    """Before: the tied weight was written in one layer's quantized form (and quantized again by the other), so the
    outputs changed by up to 1.6 where fold_weight promises none."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.a, self.b = nn.LayerNorm(16), nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
            self.b.weight = self.a.weight
            self.c = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln(x)
            return self.c(self.a(h) + self.b(torch.relu(h) * 3))

    torch.manual_seed(0)
    x = torch.randn(8, 16)
    x[:, 2] *= 40
    m = mtq.quantize(Tied(), mtq.INT8_SMOOTHQUANT_CFG, lambda m: m(x))
    before = m(x)
    with pytest.warns(RuntimeWarning, match=r"2 layer\(s\) share their weight with another module \(a, b\)"):
        mtq.fold_weight(m)
    assert torch.equal(m(x), before)
    assert m.a.weight_quantizer.enabled and not m.c.weight_quantizer.enabled  # c (not shared) folded


def test_presets_quantize_conv_transpose_per_output_channel() -> None:
    """Before: ``axis: 0`` of INT8_DEFAULT_CFG / FP8_DEFAULT_CFG was refused on a ConvTranspose (a UNet or decoder
    script failed on the import change); it means per output channel, axis 1 of that weight."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    for cfg in (mtq.INT8_DEFAULT_CFG, mtq.FP8_DEFAULT_CFG):
        m = mtq.quantize(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ConvTranspose2d(8, 4, 2, stride=2)), cfg,
                         lambda m: m(x))
        wq = m[1].weight_quantizer
        if cfg is mtq.FP8_DEFAULT_CFG:  # per tensor in that preset
            assert wq.axis is None and torch.equal(wq.amax, m[1].weight.detach().abs().max())
            continue
        assert wq.axis == 1 and wq.amax.shape == (4,)
        torch.testing.assert_close(wq.amax, m[1].weight.detach().abs().amax(dim=(0, 2, 3)))


def test_a_negative_amax_and_a_list_of_patterns_are_refused() -> None:
    m = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(32, 16)))
    with pytest.raises(UsageError, match=r"amax holds a negative or NaN value"):
        mtq.postprocess_amax(m, "*input_quantizer", lambda a: -a)  # every input quantized to about 0, before
    with pytest.raises(UsageError, match=r"wildcard_or_filter=\['\*0\*', '\*2\*'\] must be one fnmatch pattern"):
        mtq.disable_quantizer(m, ["*0*", "*2*"])


def test_activations_calibrate_in_the_float_network() -> None:
    """Reference: max |input| of the second layer in the float model (ModelOpt, pytorch-quantization and TensorRT
    observe activations with every quantizer passing through; the weights were fake-quantized here before)."""
    torch.manual_seed(0)
    float_model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    x = torch.randn(256, 64)
    m = mtq.quantize(copy.deepcopy(float_model), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with torch.no_grad():
        assert torch.equal(m[1].input_quantizer.amax, float_model[0](x).abs().max())
