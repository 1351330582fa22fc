"""tokenize(): equal to the tokenizer's own encode(), across processes, cached on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from overdrive._utils.errors import UsageError

tokenizers = pytest.importorskip("tokenizers")

from overdrive.data.tokenize import local_corpus, tokenize, train_local_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    lines = local_corpus(max_files=40)
    return lines[:3000] + ["", "ünïcödé and emoji 🚀 text", "a" * 500]


@pytest.fixture(scope="module")
def tok(corpus: list[str]):
    return train_local_tokenizer(corpus, vocab_size=2000)


@pytest.mark.parametrize("workers", [0, 2])
def test_equal_to_tokenizer_encode(corpus: list[str], tok, workers: int) -> None:
    out = tokenize(corpus, tok, num_workers=workers, chunk_size=500)
    assert len(out) == len(corpus)
    for i, t in enumerate(corpus):
        assert out[i] == tok.encode(t).ids, f"text {i} differs"
    assert out[0][0] == tok.token_to_id("[CLS]")


def test_truncation_and_no_special_tokens(corpus: list[str], tok) -> None:
    out = tokenize(corpus, tok, max_length=16, add_special_tokens=False, num_workers=0)
    assert int(out.lengths().max()) <= 16
    for i in range(0, len(corpus), 97):
        assert out[i] == tok.encode(corpus[i], add_special_tokens=False).ids[:16]
    assert tok.truncation is None  # the caller's tokenizer is left as it was


def test_cache_round_trip(corpus: list[str], tok, tmp_path: Path) -> None:
    a = tokenize(corpus, tok, num_workers=0, cache_dir=tmp_path)
    b = tokenize(corpus, tok, num_workers=0, cache_dir=tmp_path)
    assert not a.from_cache and b.from_cache
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.offsets, b.offsets)
    c = tokenize(corpus[:-1], tok, num_workers=0, cache_dir=tmp_path)  # different texts: a different key
    assert not c.from_cache and len(c) == len(corpus) - 1
    assert len(list(tmp_path.glob("*.npz"))) == 2


def test_padded_tensors(tok) -> None:
    out = tokenize(["short", "a somewhat longer sentence here"], tok, num_workers=0)
    ids, mask = out.padded(pad_id=0)
    assert ids.shape == mask.shape == (2, len(out[1]))
    assert ids[0, : len(out[0])].tolist() == out[0] and int(mask[0].sum()) == len(out[0])
    assert ids[0, len(out[0]):].eq(0).all()


def test_tokenizer_json_path(tok, tmp_path: Path) -> None:
    p = tmp_path / "tokenizer.json"
    tok.save(str(p))
    assert tokenize(["hello world"], str(p), num_workers=0)[0] == tok.encode("hello world").ids


def test_bad_inputs(tok) -> None:
    with pytest.raises(UsageError, match="sequence of strings"):
        tokenize("one string", tok)
    with pytest.raises(UsageError, match=r"texts\[1\]"):
        tokenize(["ok", 3], tok)
    with pytest.raises(UsageError, match="max_length"):
        tokenize(["ok"], tok, max_length=0)
    with pytest.raises(UsageError, match="not a tokenizers.Tokenizer"):
        tokenize(["ok"], object())


def test_batch_padding_of_the_tokenizer_does_not_leak(corpus: list[str], tok) -> None:
    """A tokenizer with padding enabled: each text's ids still equal its own encode() (encode_batch padded each
    chunk to its longest text), and the caller's tokenizer keeps its padding setting."""
    import copy

    padded_tok = copy.deepcopy(tok)
    padded_tok.enable_padding(pad_id=0)
    texts = corpus[:50]
    out = tokenize(texts, padded_tok, num_workers=0, chunk_size=7)
    assert [out[i] for i in range(len(texts))] == [padded_tok.encode(t).ids for t in texts]
    assert padded_tok.padding is not None


def test_negative_indices_and_range(corpus: list[str], tok) -> None:
    out = tokenize(corpus[:5], tok, num_workers=0)
    assert out[-1] == tok.encode(corpus[4]).ids and out[-5] == tok.encode(corpus[0]).ids
    with pytest.raises(IndexError):
        out[5]
    with pytest.raises(IndexError):
        out[-6]


def test_cache_key_separates_texts_containing_nul(tok, tmp_path: Path) -> None:
    a = tokenize(["hello\x00world", "fox"], tok, num_workers=0, cache_dir=tmp_path)
    b = tokenize(["hello", "world\x00fox"], tok, num_workers=0, cache_dir=tmp_path)
    assert not b.from_cache and b[0] == tok.encode("hello").ids and a[1] == tok.encode("fox").ids
