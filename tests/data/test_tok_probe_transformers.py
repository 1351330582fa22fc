"""tokenize() given transformers tokenizers: fast ones equal to their own call, slow ones refused clearly."""

from __future__ import annotations

import pytest

from overdrive._utils.errors import UsageError
from overdrive.data.tokenize import local_corpus, tokenize, train_local_tokenizer


@pytest.fixture(scope="module")
def hf_fast():
    transformers = pytest.importorskip("transformers")
    tok = train_local_tokenizer(local_corpus(10)[:200], vocab_size=300)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]")


def test_slow_tokenizer_refused_with_a_short_message_naming_its_type_and_the_fix() -> None:
    """A slow tokenizer's error printed its repr: every added token, hundreds of lines for ByT5 (was unreadable)."""
    transformers = pytest.importorskip("transformers")
    slow = transformers.ByT5Tokenizer()
    with pytest.raises(UsageError, match=r"slow \(Python\) transformers tokenizer \(.*ByT5Tokenizer\).*"
                                         r"AutoTokenizer.from_pretrained") as info:
        tokenize(["hello"], slow, num_workers=0)
    assert len(str(info.value)) < 500 and "extra_id" not in str(info.value)


def test_unknown_tokenizer_object_message_is_bounded() -> None:
    with pytest.raises(UsageError, match=r"\(builtins.list\) is not a tokenizers.Tokenizer") as info:
        tokenize(["hello"], list(range(1000)), num_workers=0)
    assert len(str(info.value)) < 300


def test_text_pairs_refused_saying_pairs_are_not_supported(hf_fast) -> None:
    with pytest.raises(UsageError, match=r"texts\[0\] is a tuple .*text pairs are not supported"):
        tokenize([("a question", "its context")], hf_fast, num_workers=0)


@pytest.mark.parametrize("max_length", [None, 12])
def test_fast_tokenizer_ids_and_mask_equal_its_own_call(hf_fast, max_length: int | None) -> None:
    texts = ["def foo(x): return x + 1", "a", "", "import os  # and [SEP] in the text " * 3]
    out = tokenize(texts, hf_fast, max_length=max_length, num_workers=0)
    ref = hf_fast(texts, truncation=max_length is not None, max_length=max_length, padding=True)
    ids, mask = out.padded(pad_id=hf_fast.pad_token_id)
    assert ids.tolist() == ref["input_ids"] and mask.tolist() == ref["attention_mask"]
