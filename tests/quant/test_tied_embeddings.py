"""Tied-embedding LLMs after conversion: the vocabulary matrix is held and saved once (the embedding reads the
converted head's rows), the lookup equals the head's dequantized weight, and greedy generation follows the float
model."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from overdrive import quant

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 1024, 64


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


IDS = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))


def _calibrate(m: torch.nn.Module) -> None:
    with torch.no_grad():
        m(IDS)


CONVERT = {
    "weight_only_int8": lambda m: quant.weight_only(m, bits=8, group_size=32, min_features=0),
    "weight_only_int4": lambda m: quant.weight_only(m, bits=4, group_size=32, min_features=0),
    "dynamic_int8": quant.dynamic_int8,
    "to_real_int8": lambda m: quant.to_real(quant.quantize(m, quant.INT8_DEFAULT, forward_loop=_calibrate)),
}


def _bytes_held(m: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters and buffers (a tied tensor counts once)."""
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes()
                for t in [*m.parameters(), *m.buffers()]}.values())


def _saved_bytes(m: torch.nn.Module) -> int:
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    return len(buf.getvalue())


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("kind", list(CONVERT))
def test_tied_vocab_matrix_is_held_and_saved_once(make, kind: str) -> None:
    ref = make()
    float_table = VOCAB * HIDDEN * 4  # the fp32 (vocab, hidden) matrix the float model holds once
    model = CONVERT[kind](copy.deepcopy(ref))
    emb = model.get_input_embeddings()
    # no float (vocab, hidden) table is left beside the converted head, in memory or in the saved state_dict,
    # and converting shrinks the model by at least 3/4 of the table (int8 or int4 instead of fp32)
    held = [*model.parameters(), *model.buffers()]
    assert not [t.shape for t in held if t.is_floating_point() and t.shape == (VOCAB, HIDDEN)]
    assert not [k for k, t in model.state_dict().items() if t.is_floating_point() and t.shape == (VOCAB, HIDDEN)]
    assert _bytes_held(ref) - _bytes_held(model) >= 0.7 * float_table
    assert _saved_bytes(ref) - _saved_bytes(model) >= 0.7 * float_table
    # the lookup is the head's dequantized weight, row for row
    assert isinstance(emb, quant.TiedEmbedding) and emb.head is model.lm_head
    torch.testing.assert_close(emb(IDS), model.lm_head.weight[IDS], rtol=0, atol=0)
    with torch.no_grad():
        want = ref.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = model.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert (got == want).float().mean() >= 0.9


def test_tie_survives_copy_cast_and_reload() -> None:
    model = CONVERT["weight_only_int4"](_llama())
    clone = copy.deepcopy(model)
    assert clone.model.embed_tokens.head is clone.lm_head
    clone = clone.to(torch.bfloat16)  # the head's scales cast once; the embedding follows it
    assert clone.model.embed_tokens(IDS).dtype == torch.bfloat16
    fresh = CONVERT["weight_only_int4"](_llama())
    with torch.no_grad():
        fresh.lm_head.q.zero_()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.model.embed_tokens(IDS), model.model.embed_tokens(IDS))


def test_excluded_head_stays_float_and_tied() -> None:
    model = quant.weight_only(_llama(), bits=8, group_size=32, min_features=0, exclude=("lm_head",))
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight
