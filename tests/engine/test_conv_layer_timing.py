"""The per-layer timing of int8/fp8 convolutions (engine/layer_choice.py): each convolution timed in the fused form
the engine gives it (engine/lowp_conv_fusion.py), against a float twin with its dequantized weights; the conv plan,
tile tuning and cached timings, and the re-timing of neighbours of a convolution that went float. On CPU the op runs
its fp32 reference; the timing's verdicts are forced where a test needs one."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from overdrive.quant.conv import Int8Conv2d

from .test_conv_fusion import _randomize_bn
from .test_lowp_conv_fusion import CL, _quantized, _resnet_blocks


@pytest.mark.parametrize("margin,reverted", [(1e9, 0), (1e-9, 2)])
def test_layer_timing_takes_quantized_convolutions(margin: float, reverted: int) -> None:
    """The per-layer choice times Int8Conv2d / Fp8Conv2d against a float Conv2d with the dequantized weights and puts
    that twin in where the low-precision kernel loses (here forced by the margin); the twin computes the same
    convolution up to the activation rounding."""
    from overdrive.engine.layer_choice import keep_float_where_faster

    m = nn.Sequential(Int8Conv2d.from_float(nn.Conv2d(16, 16, 3, padding=1), torch.tensor(4.0)), nn.ReLU(),
                      Int8Conv2d.from_float(nn.Conv2d(16, 32, 1, stride=2), torch.tensor(4.0))).eval()
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=CL)
    with torch.no_grad():
        before = m(x)
    m, kept = keep_float_where_faster(m, (x,), torch.device("cpu"), torch.float32, margin=margin, conv_margin=margin)
    assert len(kept) == reverted
    assert sum(type(c) is nn.Conv2d for c in m) == reverted
    if reverted:
        assert all("k3x3" in why or "k1x1" in why for why in kept.values())
        with torch.no_grad():
            after = m(x)
        assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0).item() > 0.999


@pytest.mark.parametrize("qres", [False, True])
def test_layer_timing_times_each_convolution_in_its_fused_form(qres: bool) -> None:
    """With the plan (how the engine's pass will fuse each convolution) the timing runs each layer in that form:
    residual (float or 8-bit), ReLU, 8-bit or dual output, and says so in its verdict; forced by the margin, every
    layer reverts to its float twin and the model still computes the same function up to activation rounding."""
    from overdrive.engine.layer_choice import conv_plan, keep_float_where_faster

    m, x = _resnet_blocks()
    q = _quantized(m, Int8Conv2d, x).eval()
    plan = conv_plan(q, (x,), quantize_residuals=qres)
    assert plan["1.c1"] == {"residual": None, "relu": True, "out": "8-bit"}
    assert plan["1.c3"] == {"residual": "8-bit" if qres else "float", "relu": True, "out": "8-bit" if qres else "dual"}
    assert plan["0.short.0"] == {"residual": None, "relu": False, "out": "float"}
    with torch.no_grad():
        before = q(x)
    q, kept = keep_float_where_faster(q, (x,), torch.device("cpu"), torch.float32, margin=1e-9, conv_margin=1e-9,
                                        plan=plan)
    assert len(kept) == 10 and not any(isinstance(c, Int8Conv2d) for c in q.modules())
    assert set(q._overdrive_layer_timing_s) == {"lowp", "float"}  # the build's phases (CPU: no tile tuning)
    assert kept["1.c3"].endswith(f"{' +res8' if qres else ' +res'} relu ->{'8-bit' if qres else 'dual'}")
    assert kept["1.c1"].endswith(" relu ->8-bit") and kept["0.short.0"].endswith(" ->float")
    with torch.no_grad():
        after = q(x)
    assert torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0).item() > 0.999


def test_conv_plan_is_empty_without_quantized_convolutions() -> None:
    from overdrive.engine.layer_choice import conv_plan

    assert conv_plan(nn.Sequential(nn.Conv2d(4, 4, 3)), (torch.randn(1, 4, 8, 8),)) == {}


def test_a_fused_form_that_fails_to_time_falls_back_to_the_layer_alone(monkeypatch) -> None:
    # a plan entry the kernel cannot run (here: forced to fail) must not fail the build: the layer is timed alone
    from overdrive.engine import layer_choice

    real = layer_choice._time_conv

    def flaky(m, shape, dtype, fdt, device, margin, epilogue=None, config=None, warm_only=False):
        if epilogue:
            raise RuntimeError("no kernel for this epilogue")
        return real(m, shape, dtype, fdt, device, margin, None, config, warm_only)

    monkeypatch.setattr(layer_choice, "_time_conv", flaky)
    m = nn.Sequential(Int8Conv2d.from_float(nn.Conv2d(16, 16, 3, padding=1), torch.tensor(4.0)), nn.ReLU()).eval()
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=CL)
    plan = {"0": {"residual": None, "relu": True, "out": "float"}}
    _, kept = layer_choice.keep_float_where_faster(m, (x,), torch.device("cpu"), torch.float32, margin=1e-9,
                                                   conv_margin=1e-9, plan=plan)
    assert kept["0"].endswith("(alone: its fused form failed, RuntimeError)")


def test_conv_timing_takes_a_given_tile_and_can_only_warm_up() -> None:
    # the build tunes each shape's tiles once, compiles every layer's fused form side by side (warm_only: one run,
    # no timing), then times each with the tuned config, which the verdict carries
    from overdrive.engine import layer_choice

    m = Int8Conv2d.from_float(nn.Conv2d(16, 32, 3, padding=1), torch.tensor(4.0)).eval()
    shape = torch.Size((2, 16, 8, 8))
    epi = {"residual": "8-bit", "relu": True, "out": "dual"}
    cpu = torch.device("cpu")
    assert layer_choice._time_conv(m, shape, torch.float32, torch.float32, cpu, 1.1, epi, 5, warm_only=True) is None
    slower, why, cfg = layer_choice._time_conv(m, shape, torch.float32, torch.float32, cpu, 1.1, epi, 5)
    assert cfg == 5 and why.endswith("+res8 relu ->dual")
    assert layer_choice._tune_conv(m, shape, torch.float32, cpu) == -1  # CPU: the shape's default tile


def test_cached_convolution_timings_are_reused_with_their_tiles() -> None:
    # a --timing-cache's verdicts: the second timing of the same model reuses every convolution's verdict and tile
    # config (here edited in the cache, to see it taken) and times nothing
    from overdrive.engine.layer_choice import keep_float_where_faster

    m, x = _resnet_blocks(identity=1)
    q = _quantized(m, Int8Conv2d, x).eval()
    timings: dict = {}
    a, kept_a = keep_float_where_faster(copy.deepcopy(q), (x,), torch.device("cpu"), torch.float32, margin=1e9,
                                        conv_margin=1e9, timings=timings)
    assert a._overdrive_timings_reused == 0 and len(timings) >= 5  # one per distinct layer shape and epilogue
    assert set(a._overdrive_layer_timing_s) == {"lowp", "float"}
    timings = {k: [v[0], v[1], 5] for k, v in timings.items()}  # every convolution's tile: config 5
    b, kept_b = keep_float_where_faster(copy.deepcopy(q), (x,), torch.device("cpu"), torch.float32, margin=1e9,
                                        conv_margin=1e9, timings=timings)
    assert b._overdrive_timings_reused == len(timings) and b._overdrive_layer_timing_s == {}
    assert kept_b == kept_a == {} and all(c.config == 5 for c in b.modules() if isinstance(c, Int8Conv2d))
    broken = {k: ["not", "a verdict"] for k in timings}  # a malformed entry is timed again, not trusted
    c, _ = keep_float_where_faster(copy.deepcopy(q), (x,), torch.device("cpu"), torch.float32, margin=1e9,
                                   conv_margin=1e9, timings=broken)
    assert c._overdrive_timings_reused == 0 and all(len(v) == 3 for v in broken.values())


@pytest.mark.parametrize("act", [1, 2])
def test_conv_timing_runs_the_activation_form(act: int) -> None:
    # the fused-form timing of a layer whose plan has an activation runs conv2d_q with it and says so
    from overdrive.engine import layer_choice

    m = Int8Conv2d.from_float(nn.Conv2d(16, 32, 1), torch.tensor(4.0)).eval()
    epi = {"residual": None, "relu": False, "out": "float", "act": {1: "silu", 2: "gelu"}[act]}
    _, why, _ = layer_choice._time_conv(m, torch.Size((2, 16, 6, 6)), torch.float32, torch.float32,
                                        torch.device("cpu"), 1.1, epi, -1)
    assert why.endswith(f" {epi['act']} ->float")


def test_an_input_quantized_after_a_float_convolution_is_marked_in_the_plan() -> None:
    """A convolution whose input the engine quantizes after a float convolution (+ BatchNorm + ReLU: cuDNN's fused
    kernel writes fp16, so the quantize is a pass of its own) says so in its plan; after a pooling (where Inductor
    fuses the quantize into the pass it runs anyway) or another low-precision convolution it does not."""
    from overdrive.engine.layer_choice import conv_plan

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f, self.bn = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
            self.a = Int8Conv2d.from_float(nn.Conv2d(16, 16, 1), torch.tensor(4.0))
            self.b = Int8Conv2d.from_float(nn.Conv2d(16, 16, 1), torch.tensor(4.0))
            self.c = Int8Conv2d.from_float(nn.Conv2d(16, 16, 1), torch.tensor(4.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(torch.relu(self.bn(self.f(x))))  # after a float conv: quantized in a pass of its own
            y = self.b(torch.relu(y))  # after a low-precision conv: its 8-bit output
            return self.c(nn.functional.max_pool2d(y, 2))  # after a pooling: fused into it

    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=CL)
    plan = conv_plan(_randomize_bn(Net()).eval(), (x,))
    assert plan["a"].get("input") == "float conv"
    assert "input" not in plan["b"] and "input" not in plan["c"]


def test_neighbours_of_a_convolution_gone_float_are_timed_again_in_their_new_form(monkeypatch) -> None:
    """Once a convolution goes float its neighbours run in another form than planned (its producer writes float, not
    8-bit; its reader quantizes its input in a pass of its own): each is timed again in that form and goes float too
    where it loses there; layers whose form did not change are not timed again."""
    import overdrive.engine.layer_choice as lc
    from overdrive.engine.layer_choice import conv_plan, keep_float_where_faster

    m, x = _resnet_blocks(identity=1)
    q = _quantized(m, Int8Conv2d, x).eval()
    timed: list[tuple[str, tuple]] = []
    names = {id(mod): n for n, mod in q.named_modules()}

    def fake_time(mod, shape, dtype, fdt, device, margin, epi=None, config=None, warm_only=False):  # noqa: ANN001
        name, form = names[id(mod)], tuple(sorted((epi or {}).items()))
        timed.append((name, form))
        slower = name == "1.c2" or (name == "1.c3" and (epi or {}).get("input") == "float conv")
        return slower, f"int8 {'0.9' if slower else '1.2'}x float32 at {name}", -1

    monkeypatch.setattr(lc, "_time_conv", fake_time)
    plan = conv_plan(q, (x,))
    assert plan["1.c1"]["out"] == "8-bit" and "input" not in plan["1.c3"]
    q, kept = keep_float_where_faster(q, (x,), torch.device("cpu"), torch.float32, plan=plan,
                                        replan=lambda mdl: conv_plan(mdl, (x,)))
    assert set(kept) == {"1.c2", "1.c3"}  # c3 loses once its input comes from the float c2
    again = [n for n, _ in timed[len(plan):]]
    assert sorted(again) == ["1.c1", "1.c3"] and q._overdrive_replanned == 2
    assert dict(timed[len(plan):])["1.c1"] == tuple(sorted({"residual": None, "relu": True, "out": "float"}.items()))
    with torch.no_grad():
        want = _quantized(m, Int8Conv2d, x).eval()(x)
        assert torch.nn.functional.cosine_similarity(q(x).flatten(), want.flatten(), dim=0).item() > 0.999
