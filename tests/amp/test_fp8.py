"""fp8 training (amp.Fp8) on CPU in emulation mode: numerics, scale updates, the shape rule, the O2 machinery,
checkpoints, JSON and the refusals. The GEMMs run in fp32 when emulated, the fp8 casts as on the GPU, so the
numerics checked here are the GPU's up to the GEMM's accumulation order. Real fp8 steps: test_fp8_gpu.py."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from overdrive import UsageError, amp
from overdrive._utils.errors import MissingDependencyError
from overdrive.amp import Fp8, Policy, prepare
from overdrive.amp import fp8 as fp8_mod
from overdrive.amp.config import check_fp8_on_device

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

needs_torchao = pytest.mark.skipif(not fp8_mod.is_available(), reason="needs torchao (pip install -e '.[fp8]')")


def emulated(recipe: str = "tensorwise", **kw: object) -> Fp8:
    return Fp8(recipe=recipe, emulate=True, **{"min_features": 0, "min_weight": 0, **kw})


class MLP(nn.Module):
    """Two fp8-sized layers, a LayerNorm (fp32 at O2) and a head whose 10 outputs fp8 cannot take."""

    def __init__(self, d: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, d) -> (B, 10)
        return self.head(self.norm(self.down(torch.relu(self.up(x)))))


def data(n: int = 32, d: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, (x[:, :10] > 0).long().argmax(1)  # a learnable target


# --- the reference: fp8 casts written out in fp32 ------------------------------------------------
def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None, pow2: bool = False) -> torch.Tensor:
    """``t`` through ``dtype`` with a dynamic scale (max representable / amax), per tensor or along ``dim``; back in
    fp32. The scale is computed in float64 and rounded to float32, as torchao does; rowwise rounds it down to a
    power of two."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fmax = torch.finfo(dtype).max
    return (t * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def reference(recipe: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """y = x W^T and its gradients with the recipe's casts. x (M, K), w (N, K), g = dL/dy (M, N)."""
    if recipe == "tensorwise":  # one scale per tensor; gradients in e5m2
        xq, wq = quantize(x, E4M3), quantize(w, E4M3)
        gq = quantize(g, E5M2)
        return xq @ wq.T, gq @ wq, gq.T @ xq
    # rowwise: scales along each GEMM's reduction dim, power-of-two, e4m3 everywhere
    y = quantize(x, E4M3, -1, True) @ quantize(w, E4M3, -1, True).T           # reduce over K
    dx = quantize(g, E4M3, -1, True) @ quantize(w, E4M3, 0, True)             # reduce over N
    dw = quantize(g, E4M3, 0, True).T @ quantize(x, E4M3, 0, True)            # reduce over M
    return y, dx, dw


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def fp8_linear(recipe: str, k: int = 256, n: int = 128) -> tuple[nn.Module, nn.Linear]:
    """(the converted model, an fp32 copy of its Linear)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, n, bias=False))
    plain = copy.deepcopy(model[0])
    fp8_mod.convert(model, emulated(recipe))
    return model, plain


@needs_torchao
@pytest.mark.parametrize("recipe", amp.FP8_RECIPES)
def test_forward_backward_match_the_fp8_reference(recipe: str) -> None:
    model, plain = fp8_linear(recipe)
    assert type(model[0]).__name__ == "Float8Linear"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g).requires_grad_()
    dy = torch.randn(64, 128, generator=g)
    y = model(x)
    y.backward(dy)
    ref_y, ref_dx, ref_dw = reference(recipe, x.detach(), plain.weight.detach(), dy)
    # the same casts and an fp32 GEMM: equal up to fp32 summation order
    for got, want in ((y, ref_y), (x.grad, ref_dx), (model[0].weight.grad, ref_dw)):
        assert rel(got, want) < 1e-5
    # against unquantized fp32: e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per element, about
    # 0.026 RMS for normal data), so a GEMM of two e4m3 operands is off by about 0.037 relative (Frobenius);
    # e5m2 (2 bits) doubles the gradient's share to about 0.058. Bounds: 2^-4 for e4m3-only GEMMs, 2^-3 with e5m2.
    xr = x.detach().clone().requires_grad_()
    yr = plain(xr)
    yr.backward(dy)
    grad_bound = 2**-3 if recipe == "tensorwise" else 2**-4
    assert 0.01 < rel(y, yr) < 2**-4  # and it is really quantized (not an fp32 pass-through)
    assert rel(x.grad, xr.grad) < grad_bound
    assert rel(model[0].weight.grad, plain.weight.grad) < grad_bound


@needs_torchao
@pytest.mark.parametrize("recipe", amp.FP8_RECIPES)
def test_scales_follow_the_weights_every_step(recipe: str) -> None:
    """Dynamic scaling: each step scales by the current amax. After the weights change (an optimizer step, then
    a 1000x growth that would saturate e4m3 (max 448) under a scale kept from step 0) the forward still equals
    the reference computed from the current weights."""
    model, _ = fp8_linear(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(32, 256)
    for step in range(3):
        y = model(x)
        w = model[0].weight.detach()
        assert rel(y, reference(recipe, x, w, torch.zeros_like(y))[0]) < 1e-5, step
        assert rel(y, x @ w.T) < 2**-4, step
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model[0].weight.mul_(1000.0)
    y = model(x)
    assert torch.isfinite(y).all() and rel(y, x @ model[0].weight.detach().T) < 2**-4


# --- the shape rule and the summary --------------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(2048, 8192)
        self.small = nn.Linear(512, 2048)
        self.square = nn.Linear(2048, 2048)  # both dims large enough, the GEMM not (0.81x bf16 on the H200)
        self.odd = nn.Linear(2048, 2050)
        self.blocks = nn.ModuleList([nn.ModuleDict({"mlp": nn.Linear(4096, 4096), "attn": nn.Linear(4096, 4096)})])
        self.mha = nn.MultiheadAttention(32, 2)
        self.lm_head = nn.Linear(4096, 32000)


@pytest.mark.parametrize(
    ("rule", "fp8_layers"),
    [
        (Fp8(), {"big", "blocks.0.mlp", "blocks.0.attn", "lm_head"}),
        (Fp8(min_features=512, min_weight=0), {"big", "small", "square", "blocks.0.mlp", "blocks.0.attn", "lm_head"}),
        (Fp8(exclude=("lm_head", "*.attn")), {"big", "blocks.0.mlp"}),
        (Fp8(include=["small"], exclude=["*"]), {"small"}),
        (Fp8(include="odd"), {"big", "blocks.0.mlp", "blocks.0.attn", "lm_head"}),  # dims stay a hard rule
    ],
)
def test_shape_rule_and_filters(rule: Fp8, fp8_layers: set[str]) -> None:
    with torch.device("meta"):
        model = Mixed()
    choices = {c.name: c for c in fp8_mod.plan(model, rule)}
    assert {n for n, c in choices.items() if c.fp8} == fp8_layers
    assert "multiples of 16" in choices["odd"].why
    assert "own forward" in choices["mha.out_proj"].why  # MHA uses the weight directly
    if "small" not in fp8_layers and not rule.exclude:
        assert choices["small"].why == "in_features 512 < min_features 2048 (too small a GEMM to gain)"
        assert choices["square"].why == "2048x2048 weight < min_weight 16777216 (too small a GEMM to gain)"


def test_a_bare_linear_model_is_not_swapped() -> None:
    (c,) = fp8_mod.plan(nn.Linear(4096, 4096), Fp8())
    assert not c.fp8 and "wrap it" in c.why


@needs_torchao
def test_summary_after_initialize_lists_the_layers() -> None:
    model, opt = MLP(), None
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, fp8=emulated(min_features=64))
    t = amp.summary(model)
    rows = {r[0]: r for r in t.rows}
    assert rows["up"][3] == rows["down"][3] == "fp8"
    assert rows["head"][3] == "bfloat16" and "multiples of 16" in rows["head"][4]
    assert t.notes[0].startswith("2 of 3 Linear layers train in fp8 (tensorwise)")
    assert "emulated" in t.notes[-1]
    mp = amp.mixed_precision_of(opt)
    assert [c.name for c in mp.fp8_layers if c.fp8] == ["up", "down"]
    assert "fp8" in t.to_markdown()


# --- the O2 machinery: masters, loss scaling, checkpoints ----------------------------------------
def train(model: nn.Module, mp: amp.MixedPrecision, steps: int, seed: int = 0) -> list[float]:
    losses = []
    for i in range(steps):
        x, y = data(seed=seed + i % 4)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        mp.backward(loss)
        mp.step()
        mp.zero_grad()
        losses.append(loss.item())
    return losses


def fp8_run(recipe: str = "tensorwise", loss_scale: float | None = None, fp8: bool = True,
            seed: int = 0) -> tuple[MLP, torch.optim.Optimizer, amp.MixedPrecision]:
    torch.manual_seed(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    policy = Policy(opt_level="O2", dtype=torch.bfloat16, loss_scale=loss_scale,
                    fp8=emulated(recipe, min_features=64) if fp8 else None)
    return model, opt, prepare(model, opt, policy)


@needs_torchao
@pytest.mark.parametrize("recipe", amp.FP8_RECIPES)
def test_o2_fp8_trains_with_fp32_masters(recipe: str) -> None:
    model, opt, mp = fp8_run(recipe)
    assert model.up.weight.dtype is torch.bfloat16 and type(model.up).__name__ == "Float8Linear"
    assert all(q.dtype is torch.float32 for q in opt.param_groups[0]["params"])
    assert {id(model.up.weight), id(model.down.weight)} <= {id(h) for h, _ in mp.master_pairs()}
    assert model.norm.weight.dtype is torch.float32  # norms stay fp32 at O2, as without fp8
    losses = train(model, mp, 20)
    _, _, ref = fp8_run(recipe, fp8=False)
    ref_losses = train(ref.models[0], ref, 20)
    assert losses[-1] < 0.7 * losses[0]
    # bf16 everywhere else; fp8's casts move the loss by a few percent at most on this task
    assert abs(losses[-1] - ref_losses[-1]) < 0.05 * ref_losses[0]
    # the half weights are the masters rounded, after every step
    for half, master in mp.master_pairs():
        assert torch.equal(half, master.to(torch.bfloat16))


@needs_torchao
def test_loss_scaling_is_transparent_to_the_fp8_casts() -> None:
    """A static loss scale of 2^7 multiplies the gradients the e5m2 cast sees by 2^7; the dynamic scale divides
    it out before the cast, so the update is bit-identical to scale 1 (power-of-two scaling is exact)."""
    a, _, mpa = fp8_run(loss_scale=1.0)
    b, _, mpb = fp8_run(loss_scale=128.0)
    assert mpb.loss_scale == 128.0
    train(a, mpa, 3)
    train(b, mpb, 3)
    for (_, ma), (_, mb) in zip(mpa.master_pairs(), mpb.master_pairs()):
        assert torch.equal(ma, mb)


@needs_torchao
@pytest.mark.parametrize("direction", ["fp8 -> plain", "plain -> fp8"])
def test_checkpoints_move_between_fp8_and_plain_models(direction: str) -> None:
    src, _, src_mp = fp8_run(fp8=direction.startswith("fp8"), seed=1)
    train(src, src_mp, 3)
    state = copy.deepcopy(src.state_dict())
    amp_state = copy.deepcopy(src_mp.state_dict())
    dst, _, dst_mp = fp8_run(fp8=direction.endswith("fp8"), seed=2)
    assert set(state) == set(dst.state_dict())  # a Float8Linear keeps nn.Linear's keys
    dst.load_state_dict(state)
    dst_mp.load_state_dict(amp_state)  # the amp state (masters, scaler) moves too
    for (h, m), (sh, sm) in zip(dst_mp.master_pairs(), src_mp.master_pairs()):
        assert torch.equal(m, sm) and torch.equal(h, sh)
    # and into a model that never saw amp
    plain = MLP()
    plain.load_state_dict(state)
    x, _ = data()
    assert rel(plain(x), src(x)) < 0.1  # bf16 weights either way; the fp8 side's casts cost a few percent
    # both runs keep training from the loaded state
    assert all(map(lambda v: v == v, train(dst, dst_mp, 2)))


# --- JSON, the apex surface, refusals ------------------------------------------------------------
@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise", Fp8(recipe="rowwise", emulate=True, min_features=512,
                                                             include=("a.*",), exclude=("lm_head",)),
                                 {"recipe": "rowwise"}, True])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_policy_json_round_trip_with_fp8(fp8: object, level: str) -> None:
    p = Policy(opt_level=level, dtype=torch.bfloat16, fp8=fp8)
    assert isinstance(p.fp8, Fp8)
    q = Policy.from_json(p.to_json())
    assert q == p and isinstance(q.fp8, Fp8) and isinstance(q.fp8.include, tuple)
    assert json.loads(p.to_json())["fp8"]["recipe"] == p.fp8.recipe


def test_policy_without_fp8_writes_and_reads_json_as_before() -> None:
    old = ('{"cast_model_outputs": null, "cast_model_type": null, "dtype": "bfloat16", "growth_interval": 2000, '
           '"init_scale": 65536.0, "keep_batchnorm_fp32": null, "loss_scale": null, "master_weights": null, '
           '"max_loss_scale": 16777216.0, "min_loss_scale": null, "opt_level": "O2"}')
    p = Policy.from_json(old)
    assert p.fp8 is None and p.to_json() == old


@needs_torchao
@pytest.mark.parametrize("fp8", ["rowwise", Fp8(recipe="rowwise")])
def test_initialize_and_policy_agree(fp8: object) -> None:
    with pytest.raises(UsageError, match="emulate=True"):  # the CPU refuses real fp8
        m = MLP()
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O2", dtype="bf16", fp8=fp8)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wanted = Fp8(recipe="rowwise", emulate=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype="bf16", fp8=wanted)
    assert amp.mixed_precision_of(opt).policy.fp8 == wanted
    assert Policy(opt_level="O2", fp8=fp8).fp8 == Fp8(recipe="rowwise")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fp8": "blockwise"}, "'blockwise' is not one of 'tensorwise', 'rowwise'"),
        ({"fp8": 3}, "not an fp8 setting"),
        ({"fp8": Fp8(), "opt_level": "O0"}, "O0"),
    ],
)
def test_bad_fp8_settings_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        Policy(**{"opt_level": "O2", **kwargs})
    with pytest.raises(UsageError, match="min_features"):
        Fp8(min_features=-1)
    with pytest.raises(UsageError, match="include"):
        Fp8(include=("",))


def test_fp8_is_refused_on_cpu_and_old_gpus_unless_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError) as err:
        Policy(opt_level="O2", fp8="tensorwise").resolve(CPU)
    msg = str(err.value)
    assert "\n" not in msg and "cpu" in msg and "8.9" in msg and "emulate=True" in msg and "H200" in msg
    Policy(opt_level="O2", fp8=Fp8(emulate=True)).resolve(CPU)  # emulation runs anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UsageError, match=r"NVIDIA A100-SXM4-80GB \(cuda\) has 8\.0; use amp\.Fp8\(\.\.\., emulate=True\)"):
        check_fp8_on_device(Fp8(), torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_on_device(Fp8(), torch.device("cuda"))  # Hopper: fine


def test_missing_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now fails
    with pytest.raises(MissingDependencyError, match=r"torchao.*\.\[fp8\]"):
        fp8_mod.convert(MLP(), emulated())


def test_compile_check_warns_once_for_an_eager_training_forward() -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    check = fp8_mod.CompileCheck(layers)
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            layers[0](x)  # evaluation does not count
        layers[0].eval()
        layers[0](x)
        layers[0].train()
    with pytest.warns(UserWarning, match="torch.compile") as rec:
        layers[0](x)
        layers[1](x)
        layers[0](x)
    assert len(rec) == 1 and "\n" not in str(rec[0].message) and check.warned
    quiet = fp8_mod.CompileCheck([layers[0]], warn=False)  # emulation is never fast: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layers[0](x)
    assert not quiet.warned


def test_importing_amp_does_not_import_torchao() -> None:
    code = "import sys, overdrive.amp, overdrive.amp.fp8; print('torchao' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_demo_amp_stage_says_why_there_is_no_fp8_row_on_cpu() -> None:
    from types import SimpleNamespace

    from overdrive._utils.table import Table
    from overdrive.demo import amp_stage

    table = Table("amp", ["run"])
    amp_stage.fp8_row(SimpleNamespace(device=CPU), table)  # type: ignore[arg-type]
    assert table.rows == [] and len(table.notes) == 1
    assert table.notes[0].startswith("fp8 training (amp.Fp8): no row on cpu; it needs a CUDA GPU of compute capability 8.9+")


@needs_torchao
def test_a_token_count_fp8_gemms_cannot_take_is_refused_in_one_line() -> None:
    """8 tokens: the weight-gradient GEMM's inner dim would be 8 (fp8 GEMMs need multiples of 16; on the GPU
    torch._scaled_mm failed inside the backward). Refused before the forward, naming the count and the fix;
    16 tokens train."""
    from overdrive import amp
    from overdrive._utils.errors import UsageError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = amp.prepare(model, opt, amp.Policy(opt_level="O2", dtype=torch.bfloat16,
                                            fp8=amp.Fp8(emulate=True, min_features=0, min_weight=0)))
    with pytest.raises(UsageError, match="got 8 tokens .* multiple of 16"):
        model(torch.randn(8, 32))
    mp.backward(model(torch.randn(2, 8, 32)).float().square().mean())  # 2 x 8 = 16 tokens
    with torch.no_grad():
        model(torch.randn(8, 32))  # inference takes any count


def test_summary_of_a_compiled_model_uses_its_prepared_rule() -> None:
    """summary(torch.compile(model)) looked the rule up on the compile wrapper, missed it and showed the default
    rule (tensorwise, min_features 2048) instead of the one the model was prepared with."""
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    amp.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1),
                amp.Policy(opt_level="O2", dtype=torch.bfloat16,
                           fp8=amp.Fp8(recipe="rowwise", emulate=True, min_features=16, min_weight=1)))
    want = amp.summary(m)
    got = amp.summary(torch.compile(m))
    assert got.title == want.title == "fp8 layers (rowwise, min_features 16)"
    assert got.rows == want.rows
