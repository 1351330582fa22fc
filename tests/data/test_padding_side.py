"""TokenizedTexts.padded() pads on the tokenizer's side, as ``tokenizer(texts, padding=...)`` does."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError

pytest.importorskip("tokenizers")

from overdrive.data.tokenize import TokenizedTexts, local_corpus, tokenize, train_local_tokenizer  # noqa: E402

TEXTS = ["def foo(x): return x + 1", "a", "", "import os  # and a longer line of text " * 2]


@pytest.fixture(scope="module")
def tok():
    return train_local_tokenizer(local_corpus(10)[:200], vocab_size=300)


def _hf(tok, side: str):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(tok), pad_token="[PAD]",
                                                unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                                padding_side=side)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("max_length", [None, 6])
def test_padded_equals_the_transformers_call_on_its_padding_side(tok, side: str, max_length: int | None) -> None:
    """Reference: the transformers tokenizer's own padded call (exact ids and mask); left padding was right padded."""
    hf = _hf(tok, side)
    out = tokenize(TEXTS, hf, max_length=max_length, num_workers=0)
    assert out.padding_side == side
    if max_length is None:
        ref = hf(TEXTS, padding=True)
    else:
        ref = hf(TEXTS, padding="max_length", truncation=True, max_length=max_length)
    ids, mask = out.padded(pad_id=hf.pad_token_id, max_length=max_length)
    assert ids.tolist() == ref["input_ids"] and mask.tolist() == ref["attention_mask"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_side_of_a_cache_hit_is_the_calling_tokenizers(tok, side: str, tmp_path) -> None:
    """The side is not part of the cached ids: a hit made with the other side's tokenizer pads on this one's."""
    other = "left" if side == "right" else "right"
    tokenize(TEXTS, _hf(tok, other), num_workers=0, cache_dir=tmp_path)
    hf = _hf(tok, side)
    out = tokenize(TEXTS, hf, num_workers=0, cache_dir=tmp_path)
    assert out.from_cache and out.padding_side == side
    ids, mask = out.padded(pad_id=hf.pad_token_id)
    ref = hf(TEXTS, padding=True)
    assert ids.tolist() == ref["input_ids"] and mask.tolist() == ref["attention_mask"]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_tokenizers_padding_direction_sets_the_side(tok, direction: str) -> None:
    """Reference: a ``tokenizers.Tokenizer`` with batch-longest padding, ``encode_batch`` pads on its direction."""
    padded_tok = copy.deepcopy(tok)
    padded_tok.enable_padding(pad_id=0, pad_token="[PAD]", direction=direction)
    out = tokenize(TEXTS, padded_tok, num_workers=0)
    assert out.padding_side == direction
    ids, mask = out.padded(pad_id=0)
    ref = padded_tok.encode_batch(TEXTS)
    assert ids.tolist() == [e.ids for e in ref] and mask.tolist() == [e.attention_mask for e in ref]


@pytest.mark.parametrize("max_length", [None, 1, 3, 50])
def test_left_padded_equals_a_row_by_row_reference(max_length: int | None) -> None:
    """Reference: each text's first L ids copied into the end of its row, one row at a time; empty texts, a view
    whose offsets do not start at 0, and no texts at all."""
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 9, size=40)
    lens[[3, 7]] = 0
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    texts = TokenizedTexts(rng.integers(1, 1000, size=int(lens.sum())).astype(np.int32), offsets)
    empty = TokenizedTexts(np.zeros(0, np.int32), np.zeros(1, np.int64))
    for t in (texts, TokenizedTexts(texts.ids, offsets[5:]), empty):
        n = len(t)
        L = max_length if max_length is not None else int(t.lengths().max() if n else 0)
        ref = torch.full((n, L), -1, dtype=torch.long)
        ref_mask = torch.zeros((n, L), dtype=torch.long)
        for i in range(n):
            row = torch.as_tensor(t[i][:L], dtype=torch.long)
            ref[i, L - len(row):] = row
            ref_mask[i, L - len(row):] = 1
        ids, mask = t.padded(pad_id=-1, max_length=max_length, side="left")
        assert torch.equal(ids, ref) and torch.equal(mask, ref_mask)
        left = TokenizedTexts(t.ids, t.offsets, padding_side="left")  # the default follows padding_side
        assert all(torch.equal(a, b) for a, b in zip(left.padded(pad_id=-1, max_length=max_length), (ref, ref_mask)))
        assert torch.equal(left.padded(pad_id=-1, max_length=max_length, side="right")[1],
                           t.padded(pad_id=-1, max_length=max_length)[1])


def test_bad_side_is_refused_naming_it() -> None:
    t = TokenizedTexts(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]))
    with pytest.raises(UsageError, match=r"side='up' must be 'right' or 'left'"):
        t.padded(side="up")
    with pytest.raises(UsageError, match=r"padding_side='Left' must be 'right' or 'left'"):
        TokenizedTexts(t.ids, t.offsets, padding_side="Left")
