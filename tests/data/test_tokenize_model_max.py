"""tokenize() without max_length keeps texts longer than a transformers tokenizer's model_max_length whole, as
``tokenizer(texts)`` does, and warns as transformers does: a model with that many positions fails on them."""

from __future__ import annotations

import warnings

import pytest

from overdrive.data.tokenize import local_corpus, tokenize, train_local_tokenizer


@pytest.fixture()
def hf_fast():
    transformers = pytest.importorskip("transformers")
    tok = train_local_tokenizer(local_corpus(10)[:200], vocab_size=300)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", model_max_length=8)


TEXTS = ["a", "import os, sys  # a long line of text that has many tokens " * 3, ""]


def test_texts_past_model_max_length_warn_and_match_the_untruncated_call(hf_fast, tmp_path) -> None:
    ref = hf_fast(TEXTS)["input_ids"]  # transformers keeps them whole too (and warns)
    for _ in range(2):  # the second call is a cache hit: it warns as well
        with pytest.warns(RuntimeWarning, match=r"1 of 3 texts have more tokens than the tokenizer's model_max_length=8 "
                                                r".*pass max_length=8"):
            out = tokenize(TEXTS, hf_fast, num_workers=0, cache_dir=tmp_path)
        assert [out[i] for i in range(len(TEXTS))] == ref


def test_max_length_model_max_equals_truncation_true_without_warning(hf_fast) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tokenize(TEXTS, hf_fast, max_length=hf_fast.model_max_length, num_workers=0)
    assert [out[i] for i in range(len(TEXTS))] == hf_fast(TEXTS, truncation=True)["input_ids"]


def test_no_limit_set_means_no_warning(hf_fast) -> None:
    hf_fast.model_max_length = int(1e30)  # transformers' value when the model names no limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenize(TEXTS, hf_fast, num_workers=0)
