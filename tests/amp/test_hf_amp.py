"""apex.amp fine-tuning of tiny Hugging Face models (random weights, bf16 on the CPU): O1/O2/O3 against fp32,
tied embeddings, additive attention masks, generate, resume, and apex's fused norms swapped in."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.amp.casting import saturating_cast
from overdrive.apex import amp
from overdrive.apex.fp16_utils import fp32_to_fp16
from overdrive.apex.normalization import FusedLayerNorm, FusedRMSNorm

transformers = pytest.importorskip("transformers")

V, T = 96, 10  # vocabulary, sequence length
LEVELS = ("O1", "O2", "O3")


def _model(kind: str, attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                       tie_word_embeddings=True, pad_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(cfg)
    model.config._attn_implementation = attn
    return model


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    """AdamW with the usual groups: decay on matrices, none on biases, norms and other vectors."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 7:] = 0
    return ids, mask


def _step(model: nn.Module, opt: torch.optim.Optimizer, level: str | None) -> float:
    ids, mask = _batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    opt.zero_grad()
    if level is None:
        loss.backward()
    else:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    nn.utils.clip_grad_norm_(list(amp.master_params(opt)), 1.0)
    opt.step()
    return loss.item()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fine_tune_matches_fp32_and_keeps_the_tie(kind: str, level: str) -> None:
    ref = _model(kind)
    ref_opt = _adamw(ref)
    ref_losses = [_step(ref, ref_opt, None) for _ in range(4)]

    model = _model(kind)
    model, opt = amp.initialize(model, _adamw(model), opt_level=level, dtype=torch.bfloat16, verbosity=0)
    losses = [_step(model, opt, level) for _ in range(4)]
    # bf16 weights/activations: measured within 2.2e-3 of fp32 over 4 steps (O3 the furthest)
    assert losses == pytest.approx(ref_losses, abs=5e-3)

    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb is head  # still one Parameter after the half casts and the steps
    masters = list(amp.master_params(opt))
    assert len(masters) == len({id(p) for p in model.parameters()})  # one master for the tied pair
    if level == "O2":
        (master,) = [m for m in masters if m.shape == emb.shape]
        assert master.dtype == torch.float32 and torch.equal(master.to(emb.dtype), emb.detach())

    model.eval()
    ids, _ = _batch()
    with torch.no_grad():
        out = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def _additive_mask(fill: float) -> torch.Tensor:
    """(B, 1, T, T) causal mask with left padding on row 1: its first queries see no key at all."""
    keep = torch.ones(2, T, dtype=torch.bool)
    keep[1, :3] = False
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None] & keep[:, None, :]
    return torch.zeros(2, 1, T, T).masked_fill(~allowed[:, None], fill)


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_float32_min_mask_stays_finite_in_bf16(kind: str, level: str) -> None:
    # float32's min overflows bf16 to -inf; a fully masked row then gave NaN logits, loss and gradients
    ids, _ = _batch()
    labels = ids.clone()
    labels[1, :3] = -100
    mask = _additive_mask(torch.finfo(torch.float32).min)
    ref = _model(kind, attn="eager")(input_ids=ids, attention_mask=mask, labels=labels).loss
    model = _model(kind, attn="eager")
    model, opt = amp.initialize(model, _adamw(model), opt_level=level, dtype=torch.bfloat16, verbosity=0)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.isfinite(out.logits).all()
    assert out.loss.item() == pytest.approx(ref.item(), abs=4e-2)  # BERT's loss itself is a bf16 number
    with amp.scale_loss(out.loss, opt) as scaled:
        scaled.backward()
    assert all(torch.isfinite(m.grad).all() for m in amp.master_params(opt) if m.grad is not None)


def test_saturating_cast() -> None:
    x = torch.tensor([-1e9, torch.finfo(torch.float32).min, 3.0, float("-inf"), float("nan")])
    h = saturating_cast(x, torch.float16)
    assert h.tolist()[:4] == [-65504.0, -65504.0, 3.0, float("-inf")] and h[4].isnan()
    b = saturating_cast(x, torch.bfloat16)
    assert b[1].item() == -torch.finfo(torch.bfloat16).max and b[3].item() == float("-inf")
    assert fp32_to_fp16((torch.tensor([-1e9]),), torch.float16)[0].item() == -65504.0


@pytest.mark.parametrize("level", LEVELS)
def test_resume_gives_the_same_next_step(level: str) -> None:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model("llama")
        return amp.initialize(model, _adamw(model), opt_level=level, dtype=torch.bfloat16, verbosity=0)

    model, opt = build()
    for _ in range(2):
        _step(model, opt, level)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    loss = _step(model, opt, level)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    del model, opt  # amp.state_dict() covers every live initialize call: the resumed run must be the only one
    buf.seek(0)
    ckpt = torch.load(buf)
    model, opt = build()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    assert _step(model, opt, level) == loss
    for k, v in model.state_dict().items():
        assert torch.equal(v, after[k]), k


def _swap_norms(model: nn.Module) -> int:
    """Replace every nn.LayerNorm and HF LlamaRMSNorm with apex's fused forms, weights copied."""
    rms = transformers.models.llama.modeling_llama.LlamaRMSNorm
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.LayerNorm):
                new: nn.Module = FusedLayerNorm(child.normalized_shape, eps=child.eps, memory_efficient=True)
            elif isinstance(child, rms):
                new = FusedRMSNorm(child.weight.shape[0], eps=child.variance_epsilon, memory_efficient=True)
            else:
                continue
            new.load_state_dict(child.state_dict())
            setattr(module, name, new)
            n += 1
    return n


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_fused_norms_swapped_into_hf_models(kind: str) -> None:
    ref = _model(kind)
    with torch.no_grad():  # norm weights away from 1 and 0, so a dropped affine would show
        for p in ref.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    fused = copy.deepcopy(ref)
    assert _swap_norms(fused) == (6 if kind == "bert" else 5)
    ids, mask = _batch()
    a = ref(input_ids=ids, attention_mask=mask, labels=ids)
    b = fused(input_ids=ids, attention_mask=mask, labels=ids)
    a.loss.backward()
    b.loss.backward()
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-6)
    for pa, pb in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=1e-6)
    # bf16: the same up to bf16 rounding (HF rounds before the weight multiply, apex's kernel after)
    with torch.no_grad():
        ha = copy.deepcopy(ref).to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits.float()
        hb = copy.deepcopy(fused).to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits.float()
    torch.testing.assert_close(hb, ha, rtol=0, atol=2e-2)
    # O2 keeps the swapped norms in fp32
    fused, opt = amp.initialize(fused, _adamw(fused), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    norms = [m for m in fused.modules() if isinstance(m, (FusedLayerNorm, FusedRMSNorm))]
    assert all(p.dtype == torch.float32 for m in norms for p in m.parameters())
    assert fused(input_ids=ids, attention_mask=mask, labels=ids).loss.item() == pytest.approx(a.loss.item(), abs=4e-2)


def test_resume_beside_the_saved_run_says_which_run_is_in_the_way() -> None:
    model = _model("gpt2")
    model, opt = amp.initialize(model, _adamw(model), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    state = amp.state_dict()
    fresh = _model("gpt2")
    fresh, fresh_opt = amp.initialize(fresh, _adamw(fresh), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(UsageError, match="still referenced.*del"):
        amp.load_state_dict(state)
    del model, opt
    amp.load_state_dict(state)  # the fresh run alone: loads
