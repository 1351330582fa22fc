"""Sibling int8/fp8 Linear layers as one GEMM (``engine/lowp_siblings.py``, inside ``fuse_lowp_convs``).

Reference: on CPU ``overdrive::conv2d_q`` runs its fp32 reference, per output channel the same arithmetic in the one
GEMM as in each layer's own, so the grouped program must equal the modules exactly (tolerance 0; a member's SiLU
moved after the split is the same function on the same fp32 value)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from overdrive.engine.lowp_conv_fusion import fuse_lowp_convs
from overdrive.quant.triton_linear import Fp8TritonLinear, Int8TritonLinear

from .test_lowp_linear import _triton

CONV_Q = torch.ops.overdrive.conv2d_q.default


class _Decoder(nn.Module):
    """A pre-norm decoder layer: attention with separate Q/K/V (K without a bias, as Whisper's) and a gated MLP."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d), nn.Linear(d, d)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (self.q(h), self.k(h), self.v(h)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _lowp(model: nn.Module, cls: type, x: torch.Tensor, amax: dict[str, float] | None = None) -> nn.Module:
    """``model`` in eval mode with every Linear on the int8/fp8 kernel, each input amax calibrated on ``x`` (max)
    unless given."""
    return _triton(model.eval(), cls, x, amax).eval()


def _run(q: nn.Module, x: torch.Tensor, siblings: object) -> tuple[torch.Tensor, torch.Tensor, dict, int]:
    """(modules' output, grouped program's output, pass counts, conv2d_q nodes left)."""
    with torch.no_grad():
        want = q(x)
        ep = torch.export.export(q, (x,))
        counts = fuse_lowp_convs(ep, siblings=siblings)
        got = ep.module()(x)
    n = sum(1 for node in ep.graph_module.graph.nodes if node.target is CONV_Q)
    return want, got, counts, n


@pytest.mark.parametrize("cls", [Int8TritonLinear, Fp8TritonLinear])
def test_qkv_and_gate_up_run_as_one_gemm_each_with_the_same_outputs(cls: type) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    q = _lowp(_Decoder(), cls, x)
    want, got, counts, n = _run(q, x, True)
    assert counts["sibling_groups"] == 2, counts  # Q/K/V, gate/up
    assert n == 4, n  # QKV, O, gate+up, down (7 without the pass)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    _, _, plain, n_plain = _run(q, x, None)
    assert "sibling_groups" not in plain and n_plain == 7


def test_inputs_quantized_with_different_scales_stay_separate() -> None:
    # Q and K calibrated differently see different 8-bit tensors: one GEMM would compute K from Q's codes
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    q = _lowp(_Decoder(), Int8TritonLinear, x, amax={"k": 9.0})
    want, got, counts, n = _run(q, x, True)
    assert counts["sibling_groups"] == 2 and n == 5, (counts, n)  # Q+V one GEMM, K alone; gate+up
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_layer_writing_the_next_layers_8_bit_input_is_not_grouped() -> None:
    # fc1's only reader is fc2, so fc1 writes fc2's quantized input itself (one byte per element): it stays alone,
    # while its sibling `side` (float output) has no partner left
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2, self.side = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.fc1(x)) + self.side(x)

    torch.manual_seed(0)
    x = torch.randn(4, 32)
    q = _lowp(Branches(), Int8TritonLinear, x, amax={"fc1": 3.0, "side": 3.0})
    want, got, counts, n = _run(q, x, True)
    assert counts["sibling_groups"] == 0 and counts["quantized_out"] == 1 and n == 3, (counts, n)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_decider_vetoes_a_group_or_picks_its_tile_config() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    q = _lowp(_Decoder(), Fp8TritonLinear, x)
    calls: list[tuple] = []

    def decide(xv: torch.Tensor, weights: list[torch.Tensor], configs: list[int], has_bias: bool,
               out_dtype: torch.dtype) -> tuple[bool, int]:
        calls.append((tuple(xv.shape), [tuple(w.shape) for w in weights], has_bias, out_dtype))
        return len(weights) == 3, 27  # Q/K/V one GEMM on GEMM-form tile 27; gate/up vetoed

    with torch.no_grad():
        want = q(x)
        ep = torch.export.export(q, (x,))
        counts = fuse_lowp_convs(ep, siblings=decide)
        got = ep.module()(x)
    assert counts["sibling_groups"] == 1
    assert calls == [((16, 64, 1, 1), [(64, 64, 1, 1)] * 3, True, torch.float32),
                     ((16, 64, 1, 1), [(128, 64, 1, 1)] * 2, False, torch.float32)], calls
    widths = {int(n.args[1].meta["val"].shape[0]): n.args[12] for n in ep.graph_module.graph.nodes
              if n.target is CONV_Q}
    assert widths[192] == 27, widths
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_engine_groups_timed_siblings_on_gpu(precision: str) -> None:
    """An int8/fp8 engine (every layer low precision, sibling grouping asked for) of two decoder layers at 16x256
    tokens: the Q/K/V and gate/up groups are timed on the GPU, fused where one GEMM won, and the engine stays within
    8-bit tolerance of fp32."""
    from overdrive.engine import Builder, ShapeProfile

    torch.manual_seed(0)
    m = nn.Sequential(_Decoder(256, 4), _Decoder(256, 4)).eval()
    x = torch.randn(16, 256, 256)
    with torch.no_grad():
        ref = m(x)
    eng = Builder(precision=precision, device="cuda", profiles=[ShapeProfile.fixed("x", (16, 256, 256))],
                  layer_precision="all", sibling_gemms=True).build(m, (x,), input_names=["x"], calib=[(x,)])
    meta = eng.header["backend_meta"]
    timed = meta["lowp_sibling_gemms_timed"]
    assert timed, meta
    assert (meta["lowp_conv"]["sibling_groups"] > 0) == any(v.startswith("one") for v in timed), meta
    out = eng(x).float().cpu()
    cos = F.cosine_similarity(out.flatten(1), ref.flatten(1)).min().item()
    assert cos > 0.99, cos


def _timing_setup(x: torch.Tensor) -> tuple[nn.Module, dict, dict, dict]:
    """A decoder on the Triton kernel as the layer timing sees it: (model, originals, inputs, seen)."""
    from overdrive.engine.layer_groups import input_key

    q = _lowp(_Decoder(), Fp8TritonLinear, x)
    originals = {n: m for n, m in q.named_modules() if isinstance(m, Fp8TritonLinear)}
    inputs, seen = {}, {}
    def record(n: str, t: torch.Tensor) -> None:  # as keep_float_where_faster records them
        inputs.setdefault(n, input_key(t))
        seen.setdefault(n, (torch.Size((t.numel() // t.shape[-1], t.shape[-1], 1, 1)), t.dtype, False))

    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: record(n, a[0])) for n, m in originals.items()]
    with torch.no_grad():
        q(x)
    for h in hooks:
        h.remove()
    return q, originals, inputs, seen


@pytest.mark.parametrize("margin", [0.0, 1e9])
def test_layer_timing_puts_a_group_back_on_the_kernel_where_its_one_gemm_wins(margin: float) -> None:
    # the layers were judged alone: Q and K kept float, V moved to cuBLAS; gate/up stayed on the Triton kernel.
    # Judged as one GEMM (margin 0: it wins; 1e9: it loses) Q/K/V go back to the kernel together, or stay as chosen
    from overdrive.engine.layer_groups import choose_sibling_groups
    from overdrive.engine.layer_choice import _float_twin
    from overdrive.quant.real import _set

    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    q, originals, inputs, seen = _timing_setup(x)
    assert inputs["q"] == inputs["k"] == inputs["v"] != inputs["o"] and inputs["gate"] == inputs["up"]
    kept = {n: "timed slower alone" for n in ("q", "k")}
    for n in kept:
        _set(q, n, _float_twin(originals[n], torch.float32))
    _set(q, "v", originals["v"].library_twin())
    swapped = {"v"}
    verdicts = choose_sibling_groups(q, originals, inputs, seen, torch.device("cpu"), torch.float32, {}, kept,
                                     swapped, margin=margin)
    assert set(verdicts) == {"q", "k", "v"}, verdicts  # gate/up all on the kernel already: left to the graph pass
    assert "sibling group q+k+v: one Triton GEMM" in verdicts["q"] and "at 16x64->64+64+64" in verdicts["q"]
    if margin == 0.0:
        assert all(q.get_submodule(n) is originals[n] for n in "qkv") and not kept and not swapped
        assert verdicts["q"].endswith("(one GEMM)")
    else:
        assert type(q.q) is nn.Linear and type(q.v) is not Fp8TritonLinear and set(kept) == {"q", "k"}
        assert swapped == {"v"} and verdicts["q"].endswith("(kept as chosen)")
    with torch.no_grad():  # either way the model computes what its layers compute
        ep = torch.export.export(q, (x,))
        fuse_lowp_convs(ep, siblings=True)
        torch.testing.assert_close(ep.module()(x), q(x), rtol=0, atol=0)


def test_layers_with_their_own_epilogue_output_are_not_judged_as_a_group() -> None:
    # a planned 8-bit output (the layer writes its reader's quantized input) or a residual is the layer's own
    from overdrive.engine.layer_groups import choose_sibling_groups

    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    q, originals, inputs, seen = _timing_setup(x)
    from overdrive.engine.layer_choice import _float_twin
    from overdrive.quant.real import _set

    plan = {"q": {"out": "8-bit"}}
    kept = {n: "slower" for n in ("q", "k", "v")}
    for n in kept:
        _set(q, n, _float_twin(originals[n], torch.float32))
    verdicts = choose_sibling_groups(q, originals, inputs, seen, torch.device("cpu"), torch.float32, plan, kept,
                                     set(), margin=0.0)
    assert set(verdicts) == {"k", "v"} and "sibling group k+v" in verdicts["k"], verdicts


def test_a_group_whose_timing_fails_keeps_its_layers_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    # a GPU where the one GEMM cannot run (a kernel that fails to compile at that width) must not fail the build
    from overdrive.engine import layer_groups, lowp_siblings
    from overdrive.engine.layer_choice import _float_twin
    from overdrive.quant.real import _set

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel")

    timer = lowp_siblings.TimedLowpGroups(torch.device("cpu"))
    monkeypatch.setattr(timer, "_time", broken)
    xv = torch.empty(16, 64, 1, 1, dtype=torch.int8)
    assert timer(xv, [torch.empty(64, 64, 1, 1)] * 3, [-1] * 3, True, torch.float32) == (False, -1)
    assert "separate: the one GEMM failed to run (RuntimeError: no kernel)" in next(iter(timer.verdicts.values()))[2]

    monkeypatch.setattr(layer_groups, "_time_group", broken)
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    q, originals, inputs, seen = _timing_setup(x)
    kept = {n: "slower" for n in ("q", "k", "v")}
    for n in kept:
        _set(q, n, _float_twin(originals[n], torch.float32))
    verdicts = layer_groups.choose_sibling_groups(q, originals, inputs, seen, torch.device("cpu"), torch.float32, {},
                                                  kept, set(), margin=0.0)
    assert "not timed as one GEMM (RuntimeError: no kernel); kept as chosen" in verdicts["q"], verdicts
    assert set(kept) == {"q", "k", "v"} and type(q.q) is nn.Linear


def test_int8_fp8_grouping_is_asked_for_and_the_layer_timing_follows_the_build() -> None:
    # fp16 siblings group by default on CUDA; the int8/fp8 grouping only with sibling_gemms=True given, and the
    # layer timing judges groups exactly when the build will group them
    from overdrive.engine.config import BuildConfig

    assert BuildConfig().groups_siblings("cuda") and not BuildConfig().groups_lowp_siblings("cuda")
    assert BuildConfig(sibling_gemms=True).groups_lowp_siblings("cuda")
    assert not BuildConfig(sibling_gemms=True, freezing=False).groups_lowp_siblings("cuda")
    assert not BuildConfig(sibling_gemms=True).groups_lowp_siblings("cpu")  # CPU builds freeze only when asked
    assert BuildConfig(sibling_gemms=True, freezing=True).groups_lowp_siblings("cpu")
