"""The constant-attention-mask pass: a mask built from constants that masks nothing is dropped (exactly),
every other mask is kept. Reference: the eager module, bit-equal on CPU fp32 where the mask is dropped
(adding zeros to the scores changes nothing) and within 1e-6 through a compiled engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive._utils.errors import UsageError
from overdrive.engine.passes import drop_constant_attention_masks, fuse_gemm_gelu


class HFStyleAttention(nn.Module):
    """Builds its padding mask as Hugging Face BERT does when no attention_mask is given: ones -> 4-D
    expand -> (1 - m) filled with finfo.min where masked."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.heads = nn.Linear(d, 3 * d), heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        if mask is None:
            mask = torch.ones(b, s, dtype=torch.int64, device=x.device)
        m = mask[:, None, None, :].expand(b, 1, s, s).to(x.dtype)
        inv = 1.0 - m
        bias = inv.masked_fill(inv.to(torch.bool), torch.finfo(x.dtype).min)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, s, d)


class ArangeMask(nn.Module):
    """Builds its all-True mask as Hugging Face 5.x BERT does without an attention_mask: arange(s) >= 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        keep = (torch.arange(s, device=x.device) + 0)[None, None, None, :] >= 0
        return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=keep.expand(b, -1, s, s))[:, 0]


class FixedMask(nn.Module):
    """Attention with a mask taken from a buffer, or filled with a value that depends on the batch size."""

    def __init__(self, buffer: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("bias", buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        bias = self.bias if self.bias is not None else torch.full((b, 1, s, s), b - 2.0, device=x.device)
        return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=bias)[:, 0]


def _sdpa_masks(ep) -> list:
    return [n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask") for n in ep.graph.nodes
            if n.target is torch.ops.aten.scaled_dot_product_attention.default]


def _export(m: nn.Module, args: tuple, dynamic=None):
    with torch.no_grad():
        return torch.export.export(m, args, dynamic_shapes=dynamic, strict=False)


@pytest.mark.parametrize("dynamic", [False, True])
def test_all_ones_padding_mask_is_dropped_exactly(dynamic: bool) -> None:
    torch.manual_seed(0)
    m, x = HFStyleAttention().eval(), torch.randn(2, 8, 32)
    ep = _export(m, (x,), ({0: torch.export.Dim("b", min=1, max=16)},) if dynamic else None)
    assert _sdpa_masks(ep)[0] is not None
    small = torch.zeros(1, 8, 32)
    assert drop_constant_attention_masks(ep, [(x,), (small,)]) == ["scaled_dot_product_attention"]
    assert _sdpa_masks(ep) == [None]
    assert not [n for n in ep.graph.nodes if n.target is torch.ops.aten.ones.default]  # the mask chain is gone
    with torch.no_grad():
        assert torch.equal(ep.module()(x), m(x))


def test_arange_built_all_true_mask_is_dropped() -> None:
    m, x = ArangeMask().eval(), torch.randn(2, 8, 8)
    ep = _export(m, (x,), ({0: torch.export.Dim("b", min=1, max=16)},))
    assert drop_constant_attention_masks(ep, [(x,)]) == ["scaled_dot_product_attention"]
    with torch.no_grad():
        assert torch.equal(ep.module()(x), m(x))


def test_hugging_face_bert_masks_dropped_only_without_an_attention_mask_input() -> None:
    transformers = pytest.importorskip("transformers")
    from overdrive.engine.sources import by_name

    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=1000)
    bert = transformers.BertModel(cfg).eval()
    ids, mask = torch.randint(0, 1000, (2, 16)), torch.tensor([[1] * 16, [1] * 10 + [0] * 6])
    ids_only = by_name(bert, ["input_ids"])
    ep = _export(ids_only, (ids,))
    assert len(drop_constant_attention_masks(ep, [(ids,)])) == 2  # one per layer
    both = by_name(bert, ["input_ids", "attention_mask"])
    ep2 = _export(both, (ids, mask))
    assert drop_constant_attention_masks(ep2, [(ids, mask)]) == []
    with torch.no_grad():
        assert (ep.module()(ids)[0] - bert(input_ids=ids)[0]).abs().max().item() <= 1e-6
        assert (ep2.module()(ids, mask)[0] - bert(input_ids=ids, attention_mask=mask)[0]).abs().max().item() <= 1e-6


def test_mask_from_a_user_input_is_kept() -> None:
    m, x = HFStyleAttention().eval(), torch.randn(2, 8, 32)
    mask = torch.ones(2, 8, dtype=torch.int64)  # all ones in the example, but a runtime input
    ep = _export(m, (x, mask))
    assert drop_constant_attention_masks(ep, [(x, mask)]) == []
    padded = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad():
        assert torch.equal(ep.module()(x, padded), m(x, padded))


@pytest.mark.parametrize("buffer, dropped", [(torch.zeros(2, 1, 8, 8), True), (torch.full((2, 1, 8, 8), -1e4), False),
                                             (torch.ones(2, 1, 8, 8, dtype=torch.bool), True),
                                             (torch.ones(8, 8, dtype=torch.bool).tril(), False)])
def test_constant_buffer_mask_dropped_only_when_it_masks_nothing(buffer: torch.Tensor, dropped: bool) -> None:
    x = torch.randn(2, 8, 8)
    m = FixedMask(buffer).eval()
    ep = _export(m, (x,))
    assert bool(drop_constant_attention_masks(ep, [(x,)])) is dropped
    with torch.no_grad():
        assert torch.allclose(ep.module()(x), m(x), atol=1e-6)


class MutatedMask(nn.Module):
    """The mask is a buffer the forward itself updates (zeros at build, -1e4 after the first call)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.zeros(2, 1, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=self.bias)[:, 0]
        self.bias.fill_(-1e4)
        return out


def test_a_buffer_the_forward_mutates_is_not_taken_as_constant() -> None:
    x = torch.randn(2, 8, 8)
    ep = _export(MutatedMask().eval(), (x,))
    assert drop_constant_attention_masks(ep, [(x,)]) == []


def test_mask_is_checked_at_every_profile_corner() -> None:
    """The fill value b - 2 is zero at the example's batch 2 but not at the profile's batch 1: kept."""
    x = torch.randn(2, 8, 8)
    m = FixedMask().eval()
    ep = _export(m, (x,), ({0: torch.export.Dim("b", min=1, max=4)},))
    assert drop_constant_attention_masks(ep, [(x,)]) == ["scaled_dot_product_attention"]  # the example alone: zeros
    ep = _export(m, (x,), ({0: torch.export.Dim("b", min=1, max=4)},))
    assert drop_constant_attention_masks(ep, [(x,), (torch.zeros(1, 8, 8),), (torch.zeros(4, 8, 8),)]) == []
    with torch.no_grad():
        assert torch.allclose(ep.module()(x[:1]), m(x[:1]), atol=1e-6)


@pytest.mark.parametrize("aot", [None, False])  # the AOTInductor package (CPU default), and torch.compile at load
def test_engine_build_drops_the_mask_and_round_trips(tmp_path: Path, aot: bool | None) -> None:
    torch.manual_seed(0)
    m, x = HFStyleAttention().eval(), torch.randn(2, 8, 32)
    eng = Builder(precision="fp32", device="cpu", backend="inductor", aot=aot,
                  profiles=[ShapeProfile("x", (1, 8, 32), (2, 8, 32), (4, 8, 32))]).build(m, (x,), input_names=["x"])
    assert eng.header["backend_meta"]["attention_masks_dropped"] == 1
    eng.save(tmp_path / "a.engine")
    loaded = Engine.load(tmp_path / "a.engine")
    with torch.no_grad():
        for b in (1, 2, 4):
            xb = torch.randn(b, 8, 32)
            assert (loaded(xb) - m(xb)).abs().max().item() <= 1e-5


class MLP(nn.Module):
    """A transformer feed-forward block, plus a GELU that must stay: its linear output has a second user."""

    def __init__(self, d: int = 16, approximate: str = "none") -> None:
        super().__init__()
        self.up, self.down, self.side = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, d)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(x), approximate=self.approximate))
        s = self.side(x)
        return h + F.gelu(s) + s


@pytest.mark.parametrize("dynamic", [False, True])
def test_gemm_gelu_folds_the_erf_gelu_after_a_linear(tmp_path: Path, dynamic: bool) -> None:
    torch.manual_seed(0)
    m, x = MLP().eval(), torch.randn(2, 5, 16)
    ep = _export(m, (x,), ({0: torch.export.Dim("b", min=1, max=8)},) if dynamic else None)
    assert fuse_gemm_gelu(ep) == ["gelu"]  # the side linear's GELU stays: its output is used twice
    targets = [n.target for n in ep.graph.nodes]
    assert targets.count(torch.ops.aten._addmm_activation.default) == 1 and targets.count(torch.ops.aten.gelu.default) == 1
    path = tmp_path / "ep.pt2"
    torch.export.save(ep, path)  # the new nodes carry shapes, so the program serializes
    reloaded = torch.export.load(path).module()
    with torch.no_grad():
        for xb in ([x, torch.randn(7, 5, 16)] if dynamic else [x]):
            assert torch.allclose(reloaded(xb), m(xb), atol=1e-6)  # CPU ATen: the erf form, as unfused


def test_gemm_gelu_leaves_the_tanh_form() -> None:
    m, x = MLP(approximate="tanh").eval(), torch.randn(2, 5, 16)
    assert fuse_gemm_gelu(_export(m, (x,))) == []


def test_engine_gemm_gelu_option() -> None:
    torch.manual_seed(0)
    m, x = MLP().eval(), torch.randn(2, 5, 16)
    eng = Builder(precision="fp32", device="cpu", gemm_gelu=True, profiles=[ShapeProfile.fixed("x", (2, 5, 16))]
                  ).build(m, (x,), input_names=["x"])
    assert eng.info["backend"] == "inductor"  # auto picks the backend that can take the rewrite, and says why
    assert "--gemm-gelu" in eng.info["backend_reason"]
    assert eng.header["backend_meta"]["gemm_gelu_fused"] == 1
    with torch.no_grad():
        assert (eng(x) - m(x)).abs().max().item() <= 1e-5
    with pytest.raises(UsageError, match="--gemm-gelu rewrites the PyTorch graph"):
        Builder(precision="fp32", device="cpu", backend="onnxruntime", gemm_gelu=True).build(m, (x,), input_names=["x"])


def test_gemm_gelu_default_is_on_for_cuda_only() -> None:
    from overdrive.engine.backends.inductor import use_gemm_gelu
    from overdrive.engine.config import BuildConfig

    assert use_gemm_gelu(BuildConfig(), torch.device("cuda")) is True  # it won on the H200 (engine_profile_bert_ids.md)
    assert use_gemm_gelu(BuildConfig(), torch.device("cpu")) is False  # not measured on CPU: opt-in there
    assert use_gemm_gelu(BuildConfig(gemm_gelu=False), torch.device("cuda")) is False
    m, x = MLP().eval(), torch.randn(2, 5, 16)
    eng = Builder(precision="fp32", device="cpu", backend="inductor", profiles=[ShapeProfile.fixed("x", (2, 5, 16))]
                  ).build(m, (x,), input_names=["x"])
    assert eng.header["backend_meta"]["gemm_gelu_fused"] == 0
    ort = Builder(precision="fp32", device="cpu", backend="onnxruntime").build(m, (x,), input_names=["x"])
    assert ort.info["backend"] == "onnxruntime"  # the unset default asks nothing of other backends


def test_mask_pass_can_be_switched_off() -> None:
    m, x = HFStyleAttention().eval(), torch.randn(2, 8, 32)
    eng = Builder(precision="fp32", device="cpu", backend="inductor", drop_constant_masks=False,
                  profiles=[ShapeProfile.fixed("x", (2, 8, 32))]).build(m, (x,), input_names=["x"])
    assert eng.header["backend_meta"]["attention_masks_dropped"] == 0
    with torch.no_grad():
        assert (eng(x) - m(x)).abs().max().item() <= 1e-5
