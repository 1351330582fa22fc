"""Linear layers on the int8/fp8 convolution kernel (``quant.triton_linear.Int8TritonLinear``): a 1x1 convolution over the
(tokens, K, 1, 1) view, so an engine's fusion pass (engine/lowp_conv_fusion.py) puts the GELU after the layer and the
next layer's quantize into its epilogue; the layer timing then keeps each Linear on that kernel, on cuBLAS's GEMM or
in float, whichever runs fastest (engine/layer_choice.py).

References: on CPU ``overdrive::conv2d_q`` runs its fp32 reference, so the fused program must compute exactly what
the unfused modules compute; an int8 layer must equal the cuBLAS-form int8 Linear built from the same weights (both
are exact int32 sums with the same fp32 epilogue), and stay within int8 rounding of the float layer (cosine > 0.999)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.engine.layer_choice import LIBRARY, conv_plan, keep_float_where_faster
from overdrive.engine.lowp_conv_fusion import conv_epilogues, fuse_lowp_convs
from overdrive.quant.triton_linear import Fp8TritonLinear, Int8TritonLinear
from overdrive.quant.real import Int8Linear

CONV_Q = torch.ops.overdrive.conv2d_q.default


class _Block(nn.Module):
    """A pre-norm transformer MLP block: x + fc2(act(fc1(ln(x))))."""

    def __init__(self, d: int = 64, act: nn.Module | None = None) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = act or nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


def _model(act: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(act=act), _Block(act=copy.deepcopy(act) if act is not None else None)).eval()


def _triton(model: nn.Module, cls: type, x: torch.Tensor, amax_of: dict[str, float] | None = None) -> nn.Module:
    """``model`` with every Linear replaced by ``cls``, its input amax calibrated on ``x`` (max) unless ``amax_of``
    gives it by layer name."""
    q = copy.deepcopy(model)
    amax: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: amax.__setitem__(n, a[0].abs().amax()))
             for n, m in q.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        q(x)
    for h in hooks:
        h.remove()
    for n, m in [(n, m) for n, m in q.named_modules() if isinstance(m, nn.Linear)]:
        parent, _, leaf = n.rpartition(".")
        given = (amax_of or {}).get(n)
        setattr(q.get_submodule(parent), leaf, cls.from_linear(m, amax[n] if given is None else torch.tensor(given)))
    return q


def _fused(q: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.export.ExportedProgram, dict[str, int],
                                                    torch.Tensor]:
    """``q(x)`` run as modules, then ``q`` exported and fused: (modules' output, program, pass counts, its output)."""
    with torch.no_grad():
        want = q(x)
        ep = torch.export.export(q, (x,))
        counts = fuse_lowp_convs(ep)
        return want, ep, counts, ep.module()(x)


@pytest.mark.parametrize("cls", [Int8TritonLinear, Fp8TritonLinear])
def test_layer_matches_the_float_linear_over_any_leading_dims(cls: type) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    x = torch.randn(2, 3, 5, 48)
    q = cls.from_linear(lin, x.abs().amax())
    with torch.no_grad():
        got, want = q(x), lin(x)
    assert got.shape == want.shape == (2, 3, 5, 40)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cos > (0.999 if cls is Int8TritonLinear else 0.995), cos
    assert q.weight.shape == (40, 48) and q.weight.dtype == torch.float32  # model code reads layer.weight.dtype


def test_int8_layer_equals_its_cublas_twin() -> None:
    # the same int8 weights and input scale on torch._int_mm: exact int32 sums on both sides, the same fp32 epilogue
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(7, 64)
    q = Int8TritonLinear.from_linear(lin, x.abs().amax())
    twin = q.library_twin()
    assert isinstance(twin, Int8Linear) and twin.quantize_op and torch.equal(twin.w_q, q.w_q.view(32, 64))
    with torch.no_grad():
        torch.testing.assert_close(twin(x), q(x), rtol=1e-6, atol=1e-6)


def test_unsupported_sizes_are_refused_with_the_reason() -> None:
    with pytest.raises(UsageError, match="in_features=100 not a multiple of 16"):
        Int8TritonLinear.from_linear(nn.Linear(100, 64), torch.tensor(1.0))


@pytest.mark.parametrize("cls", [Int8TritonLinear, Fp8TritonLinear])
def test_gelu_and_the_next_quantize_fold_into_the_first_layer(cls: type) -> None:
    """The reshapes around each layer are looked through: fc1's epilogue takes the GELU and writes fc2's 8-bit input;
    fc2 writes float (its reader is the residual add). The program computes exactly what the modules compute."""
    model = _model()
    x = torch.randn(2, 7, 64)
    q = _triton(model, cls, x)
    want, ep, counts, got = _fused(q, x)
    assert counts["folded"] == 2 and counts["quantized_out"] == 2, counts
    plan = conv_epilogues(ep)
    assert plan["0.fc1"] == {"residual": None, "relu": False, "out": "8-bit", "act": "gelu"}
    assert plan["1.fc2"] == {"residual": None, "relu": False, "out": "float"}
    assert not any(n.target is torch.ops.aten.gelu.default for n in ep.graph.nodes)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_activation_read_before_and_after_is_not_moved() -> None:
    # fc1's output is read twice (GELU and a skip): the GELU stays a separate op, and the program is unchanged in value
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            return self.fc2(torch.nn.functional.gelu(h)) + h

    torch.manual_seed(0)
    x = torch.randn(3, 5, 32)
    q = _triton(Twice().eval(), Int8TritonLinear, x)
    want, ep, _, got = _fused(q, x)
    assert "act" not in conv_epilogues(ep)["fc1"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_timing_picks_each_layers_fastest_of_three(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per layer: the Triton form (kept), cuBLAS's GEMM (swapped for ``library_twin``, whose input quantize the layer
    before still writes in its epilogue), or float (the dequantized nn.Linear). Every result computes what the
    layers it holds compute."""
    import overdrive.engine.layer_choice as lc

    torch.manual_seed(0)
    model = nn.Sequential(_Block(act=nn.GELU()), _Block(act=nn.ReLU())).eval()  # four distinct layer forms
    x = torch.randn(2, 7, 64)
    q = _triton(model, Int8TritonLinear, x)
    # one verdict per distinct layer (shape and fused form): the two fc2 layers share theirs
    choice = {"0.fc1": "triton", "0.fc2": "cublas", "1.fc1": "float", "1.fc2": "cublas"}
    timed: list[tuple[str, str | None]] = []

    def fake_time(m, shape, dtype, fdt, device, margin, epi=None, config=None, warm_only=False):  # noqa: ANN001
        if warm_only:
            return None
        name = next(n for n, mod in q.named_modules() if mod is m)
        timed.append((name, (epi or {}).get("out")))
        pick = choice[name]
        return pick == "float", f"{pick} at {tuple(shape)}", LIBRARY if pick == "cublas" else config

    monkeypatch.setattr(lc, "_time_conv", fake_time)
    monkeypatch.setattr(lc, "_tune_conv", lambda *a, **kw: -1)
    with torch.no_grad():
        want = q(x)
    plan = conv_plan(q, (x,))
    out, kept = keep_float_where_faster(q, (x,), torch.device("cpu"), plan=plan,
                                        replan=lambda mdl: conv_plan(mdl, (x,)))
    assert list(kept) == ["1.fc1"]
    assert isinstance(out[0].fc1, Int8TritonLinear)
    assert type(out[0].fc2) is Int8Linear and type(out[1].fc2) is Int8Linear and type(out[1].fc1) is nn.Linear
    assert ("0.fc1", "8-bit") in timed  # timed as it runs: GELU in, fc2's 8-bit input out
    with torch.no_grad():
        got = out(x)
        ep = torch.export.export(out, (x,))
        fuse_lowp_convs(ep)
        fused = ep.module()(x)
    # fc2 on cuBLAS still takes its input 8-bit from fc1's epilogue
    assert conv_epilogues(ep)["0.fc1"]["out"] == "8-bit"
    torch.testing.assert_close(fused, got, rtol=0, atol=0)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() > 0.9999


def test_real_timing_runs_on_cpu_and_says_which_kernel_won() -> None:
    model = _model()
    x = torch.randn(2, 7, 64)
    q = _triton(model, Int8TritonLinear, x)
    plan = conv_plan(q, (x,))
    out, kept = keep_float_where_faster(q, (x,), torch.device("cpu"), plan=plan, margin=1e9, conv_margin=1e9)
    assert kept == {}
    why = out._overdrive_layer_verdicts["0.fc1"]
    assert "at 14x64->256 gelu ->8-bit on " in why and "(Triton " in why and "cuBLAS " in why, why


def test_to_real_puts_static_linears_on_the_convolution_kernel_when_asked() -> None:
    from overdrive import quant

    torch.manual_seed(0)
    model = _model()
    x = torch.randn(2, 7, 64)
    calibrated = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT, lambda m: m(x), fidelity=False)
    real = quant.to_real(copy.deepcopy(calibrated), linear_kernel="triton")
    assert sum(isinstance(m, Int8TritonLinear) for m in real.modules()) == 4
    plain = quant.to_real(copy.deepcopy(calibrated))
    assert sum(type(m) is Int8Linear for m in plain.modules()) == 4
    with torch.no_grad():
        torch.testing.assert_close(real(x), plain(x), rtol=1e-4, atol=1e-4)  # the same int8 arithmetic
    with pytest.raises(UsageError, match="linear_kernel='cutlass': expected 'cublas'"):
        quant.to_real(copy.deepcopy(calibrated), linear_kernel="cutlass")


def test_residual_quantizers_are_dropped_when_only_linears_use_the_kernel() -> None:
    # a Linear on the convolution kernel reads no residual, so a transformer's residual quantize/dequantize round
    # trips are dropped as before (they would only add passes and rounding)
    from overdrive.engine.backends.prepare import drop_unread_residual_quantizers
    from overdrive.quant.real import QuantizedResidualAdd

    m = nn.ModuleDict({"fc": Int8TritonLinear.from_linear(nn.Linear(16, 16), torch.tensor(1.0)),
                       "add": QuantizedResidualAdd(torch.tensor(4.0))})
    assert drop_unread_residual_quantizers(m) == 1 and not m["add"].enabled


def test_placement_names_the_kernel() -> None:
    from overdrive.engine.backends.prepare import layer_placement

    m = nn.Sequential(Int8TritonLinear.from_linear(nn.Linear(16, 16), torch.tensor(1.0)))
    m._overdrive_real = {"0": "int8 per-tensor"}
    assert layer_placement(m, torch.float16)["0"] == "int8 GEMM, Triton (overdrive::conv2d_q on the 1x1 view, " \
                                                    "epilogue fused)"


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [Int8TritonLinear, Fp8TritonLinear])
def test_fused_mlp_on_gpu_matches_the_modules(cls: type) -> None:
    """On the GPU the fused program runs the Triton GEMM (TMA) with GELU and an 8-bit output: within 8-bit rounding
    of the modules run one by one (reference: the same modules, each kernel unfused; fp8 sums in the MMA's precision)."""
    dev = torch.device("cuda")
    model = _model().to(dev).half()
    x = torch.randn(4, 197, 64, device=dev, dtype=torch.half)
    q = _triton(model, cls, x)
    want, ep, counts, got = _fused(q, x)
    with torch.no_grad():
        ref = model(x)
    assert counts["quantized_out"] == 2
    cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0).item()
    assert cos > 0.999, cos
    assert torch.nn.functional.cosine_similarity(got.float().flatten(), ref.float().flatten(), dim=0).item() > 0.99


def test_a_layer_cublas_cannot_take_is_never_timed_there() -> None:
    # torch._scaled_mm needs in/out features in multiples of 16: ViT's 1000-class head (768 -> 1000) failed an fp8
    # build on the GPU when its cuBLAS form was timed; it now counts as infinitely slow there (Triton or float win)
    from overdrive.engine.path_timing import _library_linear_ms

    lib = Fp8TritonLinear.from_linear(nn.Linear(32, 40), torch.tensor(1.0)).library_twin()
    xq = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    assert _library_linear_ms(lib, xq, False, 0, "float", torch.tensor(1.0), torch.float32,
                              torch.device("cpu")) == float("inf")


def test_lowp_linears_is_checked_and_old_configs_load(tmp_path) -> None:
    from click.testing import CliRunner

    from overdrive.cli.build import command
    from overdrive.engine import BuildConfig

    with pytest.raises(UsageError, match=r"lowp_linears 'triton' \(--lowp-linears\) is not one of timed, cublas"):
        BuildConfig(precision="fp8", lowp_linears="triton")
    old = BuildConfig(precision="int8").to_dict()
    del old["lowp_linears"]  # a config saved before the field existed
    assert BuildConfig.from_dict(old).lowp_linears == "timed"
    out = CliRunner().invoke(command, ["--onnx", str(tmp_path / "m.onnx"), "--lowp-linears", "bogus"])
    assert out.exit_code != 0 and "--lowp-linears" in out.output


def test_a_wide_range_weight_keeps_its_minus_128_in_the_cublas_twin() -> None:
    # the twin is built from this layer's integers: a wide-range quantizer's -128 must stay -128 (it was clipped to
    # -127, so the engine's output depended on which kernel the timing picked)
    torch.manual_seed(0)
    q = Int8TritonLinear(torch.randn(16, 32), torch.ones(16) * 2.0, torch.tensor(4.0), None, w_qmin=-128)
    assert int(q.w_q.min()) == -128
    twin = q.library_twin()
    x = torch.randn(5, 32).clamp(-4, 4)
    assert int(twin.w_q.min()) == -128
    with torch.no_grad():
        torch.testing.assert_close(twin(x), q(x), rtol=1e-6, atol=1e-6)


def test_bad_inputs_and_arguments_name_the_layer_and_the_fix() -> None:
    q = Int8TritonLinear.from_linear(nn.Linear(32, 16), x_amax=4.0)  # a plain number is an amax too
    with pytest.raises(UsageError, match=r"Int8TritonLinear\(32, 16\): got an input of shape \(3, 5, 64\) .* last dim "
                                         r"is 32"):
        q(torch.randn(3, 5, 64))
    with pytest.raises(UsageError, match="expected a float tensor"):
        q(torch.ones(2, 32, dtype=torch.long))
    with pytest.raises(UsageError, match=r"x_amax of shape \(32,\): the input is quantized per tensor"):
        Int8TritonLinear.from_linear(nn.Linear(32, 16), x_amax=torch.ones(32))
    with pytest.raises(UsageError, match="takes an nn.Linear, got Conv2d"):
        Int8TritonLinear.from_linear(nn.Conv2d(32, 16, 1), x_amax=4.0)


@pytest.mark.parametrize("cls", [Int8TritonLinear, Fp8TritonLinear])
def test_half_keeps_8_bit_weights_and_fp32_scales(cls: type) -> None:
    # .half() on a converted model: the 8-bit weights and fp32 scales (x_scale * w_scale can be 1e-8, an fp16
    # subnormal) keep their dtypes; the layer then computes in fp16 what it computed in fp32 (reference: fp32 run)
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    lin.weight.data *= 0.002
    x = torch.randn(6, 64)
    q = cls.from_linear(lin, x.abs().amax())
    with torch.no_grad():
        want = q(x)
        h = copy.deepcopy(q).half()
        got = h(x.half())
    assert h.w_q.dtype == q.w_q.dtype and h.scale.dtype == torch.float32 and h.x_scale.dtype == torch.float32
    assert got.dtype == torch.float16
    assert ((got.float() - want).norm() / want.norm()).item() < 2e-3


def test_a_quantize_of_a_value_changed_in_place_later_is_not_moved_into_the_epilogue() -> None:
    # fc2 reads a view of fc1's output that the model then doubles in place: step 0 moved fc2's quantize onto fc1,
    # the dual output wrote the 8-bit tensor before the mul_, and fc2 saw the value without it (1.05 off)
    class Aliased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc1(x)
            g = h.view(-1, 64)
            h.mul_(2.0)
            return self.fc2(g), h

    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    q = _triton(Aliased().eval(), Int8TritonLinear, x)
    want, _, _, got = _fused(q, x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_cast_of_the_model_changes_the_dtype_weight_reads_back_in() -> None:
    # model code reads layer.weight.dtype (HF T5 casts its hidden states to it): after .half() it said float32
    q = Int8TritonLinear.from_linear(nn.Linear(32, 16), x_amax=4.0)
    assert q.weight.dtype == torch.float32
    h = copy.deepcopy(q).half()
    assert h.weight.dtype == torch.float16 and h.w_q.dtype == torch.int8 and h.scale.dtype == torch.float32
    assert h.float().weight.dtype == torch.float32


class _TimmMlp(nn.Module):
    """timm's ``Mlp`` as a ViT builds it: fc1, GELU, Dropout, Identity norm, fc2, Dropout."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1)
        self.norm, self.fc2, self.drop2 = nn.Identity(), nn.Linear(4 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class _TimmBlock(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), _TimmMlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize("cls", [Int8TritonLinear, Fp8TritonLinear])
def test_eval_dropout_between_gelu_and_the_next_layer_does_not_stop_the_8_bit_output(cls: type) -> None:
    """export keeps an eval-mode ``aten.dropout(x, p, False)``: between fc1's GELU and fc2's quantize it left fc1
    writing float (and its timing judged that slower form, erf GELU and all; a ViT's 12 fc1 layers stayed fp16 and
    fc2's input took a quantize pass of its own). The identity dropout is dropped; the program is still exact."""
    torch.manual_seed(0)
    model = nn.Sequential(_TimmBlock(), _TimmBlock()).eval()
    x = torch.randn(2, 7, 64)
    q = _triton(model, cls, x)
    want, ep, counts, got = _fused(q, x)
    assert counts["quantized_out"] == 2, counts
    plan = conv_epilogues(ep)
    assert plan["0.mlp.fc1"] == {"residual": None, "relu": False, "out": "8-bit", "act": "gelu"}
    assert not any(n.target is torch.ops.aten.dropout.default for n in ep.graph.nodes)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dropout_of_a_model_exported_training_stays() -> None:
    from overdrive.engine.passes import drop_inference_dropout

    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Dropout(0.0))
    ep = torch.export.export(m.train(), (torch.randn(2, 4),))
    assert drop_inference_dropout(ep) == 1  # p 0 goes; the training dropout of p 0.5 stays
    assert sum(n.target is torch.ops.aten.dropout.default for n in ep.graph.nodes) == 1
    ep = torch.export.export(m.eval(), (torch.randn(2, 4),))
    assert drop_inference_dropout(ep) == 2
    x = torch.randn(2, 4)
    torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)
