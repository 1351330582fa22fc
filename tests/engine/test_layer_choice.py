"""Per-layer precision by measurement (engine/layer_choice.py): a low-precision GEMM layer that times slower than its
float twin at build goes back to float, with its dequantized weights; ``layer_precision="all"`` keeps every one.

The reference: the float layer with the int8 layer's dequantized weights (the same weight rounding, no activation
rounding), computed in fp32: a reverted layer must match it to 1e-5, and sit at least as close to the original float
layer as the int8 one does. The margins used here (0 and 1e9) make the timing decision certain on any CPU."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, BuildConfig
from overdrive.engine.layer_choice import keep_float_where_faster
from overdrive.quant.real import Int8Linear, dynamic_int8


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()


def test_margin_zero_reverts_every_layer_to_its_dequantized_float_twin() -> None:
    model = _mlp()
    x = torch.randn(16, 64)
    with torch.no_grad():
        ref = model(x)
        int8 = dynamic_int8(_mlp())
        y_int8 = int8(x)
        deq = _mlp()
        for i in (0, 2):  # the reference: float layers holding the int8 weights, dequantized
            q = int8[i]
            deq[i].weight.data = q.w_q.float() * q.w_scale.view(-1, 1)
        y_deq = deq(x)
        reverted, kept = keep_float_where_faster(int8, (x,), torch.device("cpu"), margin=0.0)
        y = reverted(x)
    assert sorted(kept) == ["0", "2"] and all(why.startswith("int8 ") and "at 16x64->128" in kept["0"]
                                              for why in kept.values())
    assert not any(isinstance(m, Int8Linear) for m in reverted.modules())
    torch.testing.assert_close(y, y_deq, rtol=1e-5, atol=1e-5)
    assert (y - ref).abs().max() <= (y_int8 - ref).abs().max() + 1e-6


def test_a_huge_margin_keeps_every_layer_low_precision() -> None:
    model = dynamic_int8(_mlp())
    _, kept = keep_float_where_faster(model, (torch.randn(16, 64),), torch.device("cpu"), margin=1e9)
    assert kept == {} and sum(isinstance(m, Int8Linear) for m in model.modules()) == 2


def test_layer_precision_is_checked_and_old_configs_load() -> None:
    with pytest.raises(UsageError, match=r"layer_precision 'fastest' \(--layer-precision\) is not one of timed, all"):
        BuildConfig(precision="int8", layer_precision="fastest")
    old = BuildConfig(precision="int8").to_dict()
    del old["layer_precision"]  # a config saved before the field existed
    assert BuildConfig.from_dict(old).layer_precision == "timed"


def test_engine_reports_each_layer_once_either_int8_or_kept_float() -> None:
    """Whatever this CPU's int8 speed, every Linear ends up counted once: as an int8 kernel or as a layer kept float
    (with why); with ``all`` every one is int8 and none is listed."""
    model = _mlp()
    x = torch.randn(8, 64)
    for lp in ("timed", "all"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng = Builder(BuildConfig(precision="int8", backend="inductor", int8_activations="dynamic",
                                      layer_precision=lp)).build(model, (x,))
        phases = eng.header["backend_meta"]["build_phases_s"]  # where the build time went, for the zoo's table
        assert {"export", "passes", "compile"} <= set(phases) and ("layer_timing" in phases) == (lp == "timed")
        if lp == "timed":  # the GEMMs' share of it (convolutions: tune, lowp, float)
            assert 0 <= phases["layer_timing.gemm"] <= phases["layer_timing"] + 0.01  # rounded to 10 ms: may be 0
        ops = sum((eng.info["int8"]["ops"] or {}).values())
        kept = eng.info["int8"].get("kept_float", {})
        assert ops + len(kept) == 2, (lp, eng.info["int8"])
        if lp == "all":
            assert ops == 2 and kept == {}
        torch.testing.assert_close(eng.runner(x)[0], model(x), rtol=0.05, atol=0.05)


@pytest.mark.gpu
def test_every_distinct_layer_is_timed_compiled_past_dynamo_recompile_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """12 int8 layers of distinct shapes (24 timings with their float twins, past dynamo's recompile limit of 8):
    every one is timed through torch.compile, as the engine runs it; before, the 9th compile on fell back to eager
    inside the shared compiled function without a word, so those layers were timed with unfused kernels."""
    import overdrive.engine.layer_choice as lc

    widths = [64 + 16 * i for i in range(13)]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])]).cuda().eval()
    int8 = dynamic_int8(model)
    compiled: list[bool] = []
    real = lc._as_engine_runs

    def spy(layer, x, device):  # noqa: ANN001, ANN202
        run = real(layer, x, device)
        compiled.append(getattr(run, "compiled", False))
        return run

    monkeypatch.setattr(lc, "_as_engine_runs", spy)
    keep_float_where_faster(int8, (torch.randn(256, 64, device="cuda"),), torch.device("cuda"), margin=1e9)
    assert len(compiled) == 24 and all(compiled), compiled
    # a second build in the same process (other shapes): dynamo's count spans the process, so the limit must cover
    # the first build's entries too (before, the second build's layers fell back to eager timing)
    compiled.clear()
    keep_float_where_faster(dynamic_int8(model), (torch.randn(96, 64, device="cuda"),), torch.device("cuda"), margin=1e9)
    assert len(compiled) == 24 and all(compiled), compiled


def test_float_twin_of_a_smoothed_layer_folds_the_input_factors() -> None:
    """A SmoothQuant int8 layer kept float by the timing computes x (W s)^T / s, the original Linear up to the int8
    weight rounding (cosine >= 0.999); dropping 1 / s (the bug: garbage, cosine -0.02 on MiniLM) fails it."""
    from overdrive.engine.layer_choice import _float_twin
    from overdrive.quant import Int8Linear, SmoothedLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    s = torch.rand(64) * 1.5 + 0.5  # factors as SmoothQuant makes them for even channels
    m = Int8Linear.dynamic(SmoothedLinear(lin.weight.detach() * s, lin.bias, 1 / s))
    x = torch.randn(16, 64)
    with torch.no_grad():
        ref, got = lin(x), _float_twin(m, torch.float32)(x)
    assert float(torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0)) >= 0.999


def test_engine_info_says_where_each_layer_runs(tmp_path) -> None:
    # engine.info["layers"]: each quantized layer's kernel, or float and why; kept in the saved engine, and the build
    # line counts them
    from overdrive.engine import Engine, ShapeProfile
    from overdrive.engine.layer_choice import placement_summary

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 1), nn.Flatten(),
                      nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    x = torch.randn(4, 16, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = Builder(BuildConfig(precision="int8", device="cpu", backend="inductor", layer_precision="all",
                                  profiles=(ShapeProfile.fixed("x", (4, 16, 8, 8)),))).build(
            m, (x,), input_names=["x"], calib=[(x,)])
    assert "calibrate" in eng.header["backend_meta"]["build_phases_s"]
    layers = eng.info["layers"]
    assert layers == {
        "0": "float32: QuantConv2d (3, 3) has no low-precision kernel here (float)",  # CPU: 1x1 convs only
        "2": "int8 1x1 conv as a GEMM (torch._int_mm)",
        "4": "int8 GEMM (torch._int_mm)",
        "6": "float32: in/out features (64, 10) not multiples of 8 (_int_mm)"}
    assert placement_summary(layers).startswith("layers: 2 float32 (no kernel), 1 int8 1x1 conv as a GEMM")
    eng.save(tmp_path / "m.engine")
    assert Engine.load(tmp_path / "m.engine").info["layers"] == layers


def _mlp_engine_at_margin(monkeypatch: pytest.MonkeyPatch, margin: float) -> tuple[Any, list[Any]]:
    """A dynamic int8 engine of :func:`_mlp` whose build judges its GEMMs at ``margin`` (0: every layer reverts to
    float; 1e9: none does), and the warnings the build raised."""
    import overdrive.engine.layer_choice as lc

    real = lc.keep_float_where_faster
    monkeypatch.setattr(lc, "keep_float_where_faster", lambda *a, **kw: real(*a, **{**kw, "margin": margin}))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        eng = Builder(BuildConfig(precision="int8", backend="inductor", int8_activations="dynamic")).build(
            _mlp(), (torch.randn(8, 64),))
    return eng, got


def test_the_all_float_warning_when_no_layer_is_left_low_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build warns "every int8 layer ran slower than float" when the timing kept every layer float (and only
    then: an fp8 build warned so beside 43 fp8 convolutions, having no int8_ops record; the next test builds with
    layers left low precision and no warning)."""
    eng, got = _mlp_engine_at_margin(monkeypatch, 0.0)
    assert any("ran slower than float" in str(w.message) for w in got)
    assert eng.header["backend_meta"]["lowp_layers"] == 0


def test_layers_kept_low_precision_carry_their_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.info["layers"] gives each layer the timing kept low precision its measured ratio (as TensorRT's verbose
    log shows the tactic it chose), and the build line still counts them by kernel."""
    from overdrive.engine.layer_choice import placement_summary

    eng, got = _mlp_engine_at_margin(monkeypatch, 1e9)
    assert not any("ran slower than float" in str(w.message) for w in got)
    assert eng.header["backend_meta"]["lowp_layers"] == 2
    layers = eng.info["layers"]
    assert sorted(layers) == ["0", "2"]
    assert all(v.startswith("int8 GEMM, per-token scales (torch._int_mm), timed int8 ") and " at 8x" in v
               for v in layers.values()), layers
    assert placement_summary(layers).startswith("layers: 2 int8 GEMM, per-token scales (torch._int_mm);")


def test_convolutions_are_judged_with_no_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A convolution's fused form is timed as the engine runs it, so it stays low precision only where it is at least
    as fast (CONV_MARGIN 1.0; the GEMMs' 1.1 let EfficientNet-B0's engines keep layers up to 10% slower); the margin
    is part of a cached verdict's key."""
    import overdrive.engine.layer_choice as lc
    from overdrive.quant.conv import Int8Conv2d

    assert lc.CONV_MARGIN == 1.0
    seen: list[float] = []

    def fake_time(m, shape, dtype, fdt, device, margin, epi=None, config=None, warm_only=False):  # noqa: ANN001
        seen.append(margin)
        return 1.05 > margin, f"{m.fmt} 0.95x float32 at conv", -1  # 5% slower than float

    monkeypatch.setattr(lc, "_time_conv", fake_time)
    monkeypatch.setattr(lc, "_tune_conv", lambda *a, **kw: -1)
    conv = Int8Conv2d.from_float(nn.Conv2d(16, 16, 3, padding=1), torch.tensor(1.0))
    model = nn.Sequential(conv)
    seen_shapes = {"0": (torch.Size([2, 16, 8, 8]), torch.float32, False)}
    swapped: list[str] = []
    timings: dict = {}
    kept = lc._choose(model, [("0", conv)], seen_shapes, torch.device("cpu"), None, 1.1,
                      lambda mdl, n, new: swapped.append(n), {}, timings)
    assert seen == [1.0] and list(kept) == ["0"] and swapped == ["0"]
    assert any("1.0, None)" in k for k in timings)  # the margin in the cached key


def _conv_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(16, 32, 1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(),
                         nn.Linear(64, 16)).eval()


@pytest.mark.parametrize("faster,dynamic,source", [("float32", False, "float"), ("int8", False, "float"),
                                                   ("float32", True, "float"), ("float32", False, "quantized"),
                                                   ("float32", True, "quantized"), ("tie", False, "float")])
def test_whole_engine_timing_keeps_the_faster_engine(monkeypatch: pytest.MonkeyPatch, tmp_path, faster: str,
                                                     dynamic: bool, source: str) -> None:
    """An int8 build whose layers all timed faster in int8 is timed once more as a whole engine against its float twin,
    and keeps the faster (forced here; on a static CUDA profile it is measured, a dynamic profile at its opt shape).
    When float wins, the saved engine runs the float program (for every batch size of a dynamic profile), reports
    every layer float and why, and warns. The twin of a float model is the float build of that model: its outputs
    match the fp32 model's to 1e-5 (its own weights, not the int8-rounded ones). The twin of a model quantized already
    (QAT) keeps the model's rounding: each int8 layer becomes a float layer holding its dequantized weights, to 1e-5.
    When int8 wins, the int8 engine is kept as built."""
    import overdrive.engine.backends.whole_engine as we
    import overdrive.engine.layer_choice as lc
    from overdrive import quant
    from overdrive.engine import Engine, ShapeProfile

    real = lc.keep_float_where_faster
    monkeypatch.setattr(lc, "keep_float_where_faster",
                        lambda *a, **kw: real(*a, **{**kw, "margin": 1e9, "conv_margin": 1e9}))  # every layer int8
    monkeypatch.setattr(we, "whole_engine_timed", lambda cfg, device: True)  # CUDA only, unforced
    calls: list[int] = []

    def paired(a, b, device, rounds=5):  # noqa: ANN001, ANN202 - both engines run; the verdict is forced
        a(), b()
        calls.append(1)
        return {"float32": (2.0, 1.0), "int8": (1.0, 2.0), "tie": (1.0, 1.01)}[faster]

    monkeypatch.setattr(we, "paired_ms", paired)
    x = torch.randn(4, 16, 8, 8)
    prof = ShapeProfile("x", (1, 16, 8, 8), (4, 16, 8, 8), (8, 16, 8, 8)) if dynamic else \
        ShapeProfile.fixed("x", (4, 16, 8, 8))
    cfg = BuildConfig(precision="int8", device="cpu", backend="inductor", aot=False, profiles=(prof,))
    loop = lambda mdl: [mdl(x) for _ in range(1)]  # noqa: E731 - the build's calibration: the one batch
    given = _conv_mlp() if source == "float" else quant.quantize(_conv_mlp(), quant.INT8_DEFAULT, loop, fidelity=False)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        eng = Builder(cfg).build(given, (x,), input_names=["x"], calib=[(x,)])
    assert calls == [1]
    whole = eng.info["whole_engine"]
    if faster == "tie":  # int8 1% faster: within WHOLE_ENGINE_MARGIN, so the float build (more accurate) is kept
        assert whole["kept"] == "float32" and "int8 1.01x float32 as a whole engine" in whole["why"]
        with torch.no_grad():
            torch.testing.assert_close(eng(x), _conv_mlp()(x), rtol=1e-5, atol=1e-5)
        return
    assert whole["kept"] == faster and whole["lowp_ms"] == (2.0 if faster == "float32" else 1.0)
    assert whole["float_weights"] == ("the float model's own weights" if source == "float" else "dequantized weights")
    assert "whole_engine_timing" in eng.info["build_phases_s"]
    quantized = quant.to_real(quant.quantize(_conv_mlp(), quant.INT8_DEFAULT, loop, fidelity=False))
    reference = _conv_mlp() if source == "float" else lc.float_everywhere(quantized, torch.float32)[0]
    with torch.no_grad():
        y_int8 = quantized(x)
        y_float = reference(x)
        y = eng(x)
    slower = [str(w.message) for w in got if "ran slower than the same engine" in str(w.message)]
    eng.save(tmp_path / "m.engine")
    loaded = Engine.load(tmp_path / "m.engine")
    if faster == "float32":
        assert eng.header["backend_meta"]["lowp_layers"] == 0 and not eng.info["int8"]["ops"]
        assert sorted(eng.info["layers"]) == ["0", "3", "5"]
        assert all(v.startswith("float32: timed faster than its low-precision kernel (int8 0.50x float32 as a whole")
                   for v in eng.info["layers"].values()), eng.info["layers"]
        assert len(slower) == 1 and "--layer-precision all" in slower[0]
        torch.testing.assert_close(y, y_float, rtol=1e-5, atol=1e-5)
        assert (y - y_int8).abs().max() > 1e-4  # the float program, not the int8 one
    else:
        assert eng.header["backend_meta"]["lowp_layers"] == 3 and not slower
        torch.testing.assert_close(y, y_int8, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), y, rtol=1e-6, atol=1e-6)  # the saved program is the one kept
        if dynamic:  # another batch size of the profile runs the same program
            x2 = torch.randn(2, 16, 8, 8)
            torch.testing.assert_close(loaded(x2), reference(x2), rtol=1e-5, atol=1e-5)


def test_an_int8_build_left_with_no_int8_layer_is_the_float_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the per-layer timing keeps every layer float (forced: margin 0) on a build that times whole engines
    (CUDA; forced here), the engine is the float build of the model, with its own weights (the fp32 model's outputs
    to 1e-5), not float layers holding int8-rounded weights; it says so and warns that every layer runs float."""
    import overdrive.engine.backends.whole_engine as we
    import overdrive.engine.layer_choice as lc
    from overdrive.engine import ShapeProfile

    real = lc.keep_float_where_faster
    monkeypatch.setattr(lc, "keep_float_where_faster",
                        lambda *a, **kw: real(*a, **{**kw, "margin": 0.0, "conv_margin": 0.0}))  # every layer float
    monkeypatch.setattr(we, "whole_engine_timed", lambda cfg, device: True)
    x = torch.randn(4, 16, 8, 8)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        eng = Builder(BuildConfig(precision="int8", device="cpu", backend="inductor", aot=False,
                                  profiles=(ShapeProfile.fixed("x", (4, 16, 8, 8)),))).build(
            _conv_mlp(), (x,), input_names=["x"], calib=[(x,)])
    meta = eng.header["backend_meta"]
    assert meta["lowp_layers"] == 0 and "the model's float build, with its own weights" in eng.info["float_build"]
    assert "whole_engine" not in meta  # nothing low precision left to time against
    assert sorted(eng.info["layers"]) == ["0", "3", "5"] and all(
        v.startswith("float32: timed faster") for v in eng.info["layers"].values())
    assert any("every int8 layer ran slower than float" in str(w.message) for w in got)
    with torch.no_grad():
        torch.testing.assert_close(eng(x), _conv_mlp()(x), rtol=1e-5, atol=1e-5)


def test_a_float_twin_that_fails_leaves_the_engine_as_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-engine timing is a check, not a step the build depends on: if the float twin cannot be built, the
    int8 engine is kept as built and the reason recorded."""
    import overdrive.engine.backends.whole_engine as we
    import overdrive.engine.layer_choice as lc
    from overdrive.engine import ShapeProfile

    real = lc.keep_float_where_faster
    monkeypatch.setattr(lc, "keep_float_where_faster",
                        lambda *a, **kw: real(*a, **{**kw, "margin": 1e9, "conv_margin": 1e9}))
    monkeypatch.setattr(we, "whole_engine_timed", lambda cfg, device: True)

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no float twin here")

    monkeypatch.setattr(we, "_float_twin_module", broken)
    x = torch.randn(4, 16, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = Builder(BuildConfig(precision="int8", device="cpu", backend="inductor", aot=False,
                                  profiles=(ShapeProfile.fixed("x", (4, 16, 8, 8)),))).build(
            _conv_mlp(), (x,), input_names=["x"], calib=[(x,)])
    whole = eng.info["whole_engine"]
    assert whole["kept"] == "int8" and "no float twin here" in whole["why"]
    assert eng.header["backend_meta"]["lowp_layers"] == 3
