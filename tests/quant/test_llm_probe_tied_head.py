"""Converted LM heads of tied-embedding causal LMs: greedy generation with and without the KV cache, a
state_dict reload into a freshly converted model, and a clear error when the tie is re-applied."""

from __future__ import annotations

import copy

import pytest
import torch

from overdrive import quant
from overdrive._utils.errors import UsageError

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


CONVERT = {
    "weight_only_int8": lambda m: quant.weight_only(m, bits=8, group_size=32, min_features=0),
    "weight_only_int4": lambda m: quant.weight_only(m, bits=4, group_size=32, min_features=0),
    "dynamic_int8": quant.dynamic_int8,
}


@pytest.mark.parametrize("kind", list(CONVERT))
def test_tie_weights_on_converted_head_is_a_clear_usage_error(kind: str) -> None:
    model = CONVERT[kind](_tiny_llama())
    with pytest.raises(UsageError, match=r"weight is read-only.*lm_head"):
        model.tie_weights()  # Hugging Face assigns lm_head.weight = embed_tokens.weight
    with pytest.raises(UsageError, match="read-only"):
        model.lm_head.weight = torch.nn.Parameter(torch.zeros(256, 64))


@pytest.mark.parametrize("kind", list(CONVERT))
def test_tied_llm_generates_like_float_and_reloads(kind: str) -> None:
    ref = _tiny_llama()
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    model = CONVERT[kind](copy.deepcopy(ref))
    # the embedding reads its rows from the converted head (one low-precision copy of the tied matrix)
    assert type(model.model.embed_tokens) is quant.TiedEmbedding
    assert type(model.lm_head).__name__ != "Linear"
    with torch.no_grad():
        for cache in (True, False):
            want = ref.generate(ids, max_new_tokens=8, do_sample=False, use_cache=cache, pad_token_id=0)
            got = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=cache, pad_token_id=0)
            assert (got == want).float().mean() >= 0.9
        fresh = CONVERT[kind](_tiny_llama())
        fresh.load_state_dict(model.state_dict())
        assert torch.equal(fresh(ids).logits, model(ids).logits)
