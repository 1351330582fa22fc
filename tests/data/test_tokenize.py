"""tokenize(): equal to the tokenizer's own encode(), across processes, cached on disk."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError

tokenizers = pytest.importorskip("tokenizers")

from overdrive.data.tokenize import TokenizedTexts, local_corpus, tokenize, train_local_tokenizer  # noqa: E402


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


def test_an_unreadable_cache_file_is_rebuilt(corpus: list[str], tok, tmp_path: Path) -> None:
    """A cache file cut short (a killed writer) or replaced by garbage raised numpy's "pickled (object) data" error,
    naming no file; it now warns, tokenizes again and writes the file anew (equal to a fresh run)."""
    a = tokenize(corpus, tok, num_workers=0, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.npz")
    for junk in (b"garbage", path.read_bytes()[:40]):
        path.write_bytes(junk)
        with pytest.warns(RuntimeWarning, match="unreadable"):
            b = tokenize(corpus, tok, num_workers=0, cache_dir=tmp_path)
        assert not b.from_cache and np.array_equal(a.ids, b.ids) and np.array_equal(a.offsets, b.offsets)
        assert tokenize(corpus, tok, num_workers=0, cache_dir=tmp_path).from_cache


def test_slices_give_lists_of_ids(corpus: list[str], tok) -> None:
    """``texts[1:3]`` raised TypeError ('<=' between int and slice)."""
    out = tokenize(corpus, tok, num_workers=0)
    assert out[1:3] == [out[1], out[2]] and out[::-1][0] == out[len(corpus) - 1] and out[5:5] == []


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
    with pytest.raises(UsageError, match="is one string; pass a list of texts"):
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


@pytest.fixture(scope="module")
def hf_tok(tok):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]")


@pytest.mark.parametrize("side", ["right", "left"])
def test_transformers_tokenizer_truncation_side(corpus: list[str], hf_tok, side: str) -> None:
    """Equal to the transformers tokenizer's own call, special tokens kept, on its truncation_side (was always right)."""
    texts = corpus[:60]
    hf_tok.truncation_side = side
    try:
        out = tokenize(texts, hf_tok, max_length=8, num_workers=0, chunk_size=16)
        want = hf_tok(texts, truncation=True, max_length=8)["input_ids"]
    finally:
        hf_tok.truncation_side = "right"
    assert [out[i] for i in range(len(texts))] == want


def test_transformers_tokenizer_state_left_by_an_earlier_call_does_not_leak(corpus: list[str], hf_tok) -> None:
    """A transformers call with truncation/padding leaves them set on the shared backend tokenizer; its next
    encode() resets them, and tokenize() must too (it truncated and padded every text to 8)."""
    texts = corpus[:40]
    hf_tok(texts, truncation=True, max_length=8, padding="max_length")
    out = tokenize(texts, hf_tok, num_workers=0)
    assert [out[i] for i in range(len(texts))] == [hf_tok.encode(t) for t in texts]
    assert max(len(out[i]) for i in range(len(texts))) > 8


def test_max_length_keeps_the_tokenizers_truncation_direction(corpus: list[str], tok) -> None:
    import copy

    left = copy.deepcopy(tok)
    left.enable_truncation(100, direction="left")
    ref = copy.deepcopy(tok)
    ref.enable_truncation(6, direction="left")
    texts = corpus[:40]
    out = tokenize(texts, left, max_length=6, num_workers=0)
    assert [out[i] for i in range(len(texts))] == [ref.encode(t).ids for t in texts]
    assert left.truncation["max_length"] == 100  # the caller's tokenizer is left as it was


def test_cache_key_changes_with_the_truncation_side(corpus: list[str], hf_tok, tmp_path: Path) -> None:
    texts = corpus[:30]
    hf_tok.truncation_side = "left"
    try:
        tokenize(texts, hf_tok, max_length=8, num_workers=0, cache_dir=tmp_path)
    finally:
        hf_tok.truncation_side = "right"
    right = tokenize(texts, hf_tok, max_length=8, num_workers=0, cache_dir=tmp_path)
    assert not right.from_cache  # it was served the left-truncated ids
    assert [right[i] for i in range(len(texts))] == hf_tok(texts, truncation=True, max_length=8)["input_ids"]


@pytest.mark.parametrize("kw", [{"num_workers": -1}, {"num_workers": 1.5}, {"max_length": 2.5}])
def test_bad_counts_are_usage_errors(tok, kw: dict) -> None:
    """These raised ValueError/TypeError from deep inside ProcessPoolExecutor or tokenizers."""
    name, value = next(iter(kw.items()))
    with pytest.raises(UsageError, match=rf"{name}={value!r} must be an int"):
        tokenize(["a b c", "d e f"], tok, chunk_size=1, **kw)


@pytest.fixture
def pool_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The process count of every worker pool tokenize starts (the pools still run)."""
    mod = importlib.import_module("overdrive.data.tokenize")  # the package attribute is the function
    sizes: list[int] = []
    real = mod.ProcessPoolExecutor

    def spy(n, **kw):  # type: ignore[no-untyped-def]
        sizes.append(n)
        return real(n, **kw)

    monkeypatch.setattr(mod, "ProcessPoolExecutor", spy)
    return sizes


def test_no_more_processes_than_chunks(corpus: list[str], tok, pool_sizes: list[int]) -> None:
    """num_workers=8 for 3 chunks started 8 processes (a fork pool starts all of its workers at once)."""
    out = tokenize(corpus[:3], tok, num_workers=8, chunk_size=1)
    assert pool_sizes == [3] and [out[i] for i in range(3)] == [tok.encode(t).ids for t in corpus[:3]]


def test_concurrent_cache_writers_of_one_key(corpus: list[str], tok, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks writing the same cache entry at once: with one shared temporary name, the second writer's
    os.replace moved the first's file away and the first failed with FileNotFoundError."""
    mod = importlib.import_module("overdrive.data.tokenize")  # the package attribute is the function

    texts = corpus[:20]
    real_savez = np.savez
    nested: list = []
    calls = []

    def savez(*args, **kw):
        real_savez(*args, **kw)
        calls.append(1)
        if len(calls) == 1:  # while the first writer is between writing and renaming, a second one writes the key
            nested.append(tokenize(texts, tok, num_workers=0, cache_dir=tmp_path))

    monkeypatch.setattr(mod.np, "savez", savez)
    first = tokenize(texts, tok, num_workers=0, cache_dir=tmp_path)
    monkeypatch.undo()
    assert not nested[0].from_cache and np.array_equal(first.ids, nested[0].ids)
    again = tokenize(texts, tok, num_workers=0, cache_dir=tmp_path)
    assert again.from_cache and np.array_equal(again.ids, first.ids)
    assert [p.name for p in tmp_path.iterdir()] == [next(tmp_path.glob("*.npz")).name]  # no temporary left behind


@pytest.mark.parametrize("make", [lambda t: (x for x in t), np.array, lambda t: iter(t)])
def test_any_iterable_of_strings(tok, make) -> None:
    """A generator or a NumPy array of strings (a pandas column's .to_numpy()) is tokenized like the list; it was
    refused with 'texts must be a sequence of strings, got generator'."""
    texts = ["hello world", "", "ünïcödé 日本語 🙂"]
    out = tokenize(make(texts), tok, num_workers=0)
    assert [out[i] for i in range(len(out))] == [tok.encode(t).ids for t in texts]


@pytest.mark.parametrize("texts,message", [
    ({"text": ["a"]}, r"texts is a mapping with keys \['text'\]; pass the column of texts, e.g. texts\['text'\]"),
    ([{"text": "a"}], r"texts\[0\] is a dict .*; a JSONL row\? pass \[row\['text'\] for row in rows\]"),
    (["a", b"b"], r"texts\[1\] is a bytes .*; decode it first"),
    (["a", None], r"texts\[1\] is a NoneType .*; drop or replace missing texts"),
])
def test_what_is_not_texts_says_what_to_pass(tok, texts, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        tokenize(texts, tok)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_lone_surrogate_is_named(tok, workers: int) -> None:
    """tokenizers raised 'TextEncodeInput must be Union[TextInputSequence, ...]' (a TypeError naming no text)."""
    texts = ["fine"] * 3 + ["bad \udc80 byte"]
    with pytest.raises(UsageError, match=r"texts\[3\] holds '\\udc80' at character 4, a lone surrogate"):
        tokenize(texts, tok, num_workers=workers, chunk_size=2)


def test_bad_tokenizer_files_and_cache_dir(tok, tmp_path: Path) -> None:
    notjson = tmp_path / "vocab.txt"
    notjson.write_text("hello\nworld\n")
    with pytest.raises(UsageError, match=r"tokenizer file '.*vocab.txt' is not a tokenizer.json \(expected value"):
        tokenize(["ok"], notjson)  # was a bare Exception from tokenizers
    with pytest.raises(UsageError, match=r"tokenizer 'nope.json' is not a file; pass the path of a tokenizer.json"):
        tokenize(["ok"], "nope.json")
    with pytest.raises(UsageError, match=r"cache_dir=.*vocab.txt' is a file; give a folder"):
        tokenize(["ok"], tok, cache_dir=notjson)  # was FileExistsError


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("direction", ["right", "left"])
def test_pad_to_multiple_of_pads_each_text_as_encode_does(corpus: list[str], tok, workers: int, direction: str) -> None:
    """``enable_padding(pad_to_multiple_of=8)``: encode() pads each text to a multiple of 8; tokenize() dropped the
    padding (batch-longest padding was removed from the tokenizer), so 84 texts in 100 came out shorter."""
    import copy

    p = copy.deepcopy(tok)
    p.enable_padding(pad_id=0, pad_token="[PAD]", pad_to_multiple_of=8, direction=direction)
    texts = corpus[:60] + [""]
    out = tokenize(texts, p, num_workers=workers, chunk_size=7)
    assert [out[i] for i in range(len(texts))] == [p.encode(t).ids for t in texts]
    assert set(out.lengths() % 8) == {0}


def test_split_special_tokens_is_honoured_and_keyed(tok, hf_tok, tmp_path: Path) -> None:
    """``encode_special_tokens`` (transformers: ``split_special_tokens``) is not in the tokenizer's JSON: tokenize()
    gave [SEP] written in a text its special id, unlike encode(), and served the other setting's cache."""
    import copy

    texts = ["hello [SEP] world", "[CLS]"]
    split = copy.deepcopy(tok)
    split.encode_special_tokens = True
    plain = tokenize(texts, tok, num_workers=0, cache_dir=tmp_path)
    for workers in (0, 2):
        out = tokenize(texts, split, num_workers=workers, chunk_size=1, cache_dir=tmp_path if workers == 0 else None)
        assert not out.from_cache and [out[0], out[1]] == [split.encode(t).ids for t in texts]
    assert [plain[0], plain[1]] == [tok.encode(t).ids for t in texts] and plain[0] != split.encode(texts[0]).ids
    hf_tok.split_special_tokens = True
    try:
        out = tokenize(texts, hf_tok, num_workers=0)
        want = hf_tok(texts)["input_ids"]
    finally:
        hf_tok.split_special_tokens = False
    assert [out[0], out[1]] == want


def test_default_workers_are_the_usable_cores(corpus: list[str], tok, monkeypatch: pytest.MonkeyPatch,
                                              pool_sizes: list[int]) -> None:
    """num_workers=None started os.cpu_count() processes: the host's cores, not the affinity mask's (a container
    given 1 core of 8 ran 8 processes)."""
    mod = importlib.import_module("overdrive.data.tokenize")
    monkeypatch.setattr(mod.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    texts = corpus[:16]
    out = tokenize(texts, tok, chunk_size=2)  # 16 texts >= 8 chunks of 2: large enough for processes
    assert pool_sizes == [2] and [out[i] for i in range(len(texts))] == [tok.encode(t).ids for t in texts]


@pytest.mark.parametrize("kw,message", [
    ({"max_length": 0}, r"max_length=0 must be an int >= 1"),  # was the longest length, as None
    ({"max_length": -1}, r"max_length=-1 must be an int >= 1"),  # was torch's 'negative dimension' RuntimeError
    ({"max_length": 2.5}, r"max_length=2.5 must be an int >= 1"),
    ({"pad_id": None}, r"pad_id=None must be an int token id"),
])
def test_padded_bad_arguments(tok, kw: dict, message: str) -> None:
    out = tokenize(["a b c", "d"], tok, num_workers=0)
    with pytest.raises(UsageError, match=message):
        out.padded(**kw)
    assert out.padded(max_length=2)[0].shape == (2, 2)


def test_a_save_pretrained_folder_names_its_tokenizer_json(hf_tok, tmp_path: Path) -> None:
    """A save_pretrained folder (as AutoTokenizer takes) was 'is not a file', naming no file to pass."""
    hf_tok.save_pretrained(tmp_path)
    with pytest.raises(UsageError, match=r"is a folder; pass its tokenizer.json \('.*tokenizer.json'\) or "
                                         r"AutoTokenizer.from_pretrained"):
        tokenize(["ok"], str(tmp_path))


@pytest.mark.parametrize("use_hf", [False, True])
def test_max_length_below_the_special_tokens_is_refused(tok, hf_tok, use_hf: bool) -> None:
    """max_length=1 with [CLS] ... [SEP]: tokenizers leaves such a text untruncated, so every row came out longer
    than max_length, silently."""
    t = hf_tok if use_hf else tok
    with pytest.raises(UsageError, match=r"max_length=1 is less than the 2 special tokens .* max_length >= 3, or "
                                         r"add_special_tokens=False"):
        tokenize(["hello world"], t, max_length=1, num_workers=0)
    cls_sep = [tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")]
    assert tokenize(["hello world"], t, max_length=2, num_workers=0)[0] == cls_sep
    assert len(tokenize(["hello world"], t, max_length=1, add_special_tokens=False, num_workers=0)[0]) == 1


def _group_texts(ids: list[list[int]], block: int, eos: int | None) -> list[list[int]]:
    """The reference: Hugging Face's run_clm ``group_texts`` in plain Python (eos appended to each text first)."""
    flat = [t for row in ids for t in (row + ([eos] if eos is not None else []))]
    n = len(flat) // block * block
    return [flat[i:i + block] for i in range(0, n, block)]


@pytest.mark.parametrize("eos", [None, 3])
@pytest.mark.parametrize("block", [1, 5, 16])
def test_packed_equals_group_texts(block: int, eos: int | None) -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(4, 60000, size=int(n)).tolist() for n in rng.integers(0, 12, size=40)]  # empty texts too
    lens = [len(r) for r in rows]
    t = TokenizedTexts(np.array([x for r in rows for x in r], np.int32), np.concatenate([[0], np.cumsum(lens)]))
    got = t.packed(block, eos_id=eos)
    assert got.dtype == torch.int64 and got.shape[1] == block
    assert got.tolist() == _group_texts(rows, block, eos)


@pytest.mark.parametrize("eos", [None, 0])
def test_packed_reads_only_its_window_of_a_shared_buffer(eos: int | None) -> None:
    # a train / val split of one tokenization shares its ids: packed() packed the whole buffer (validation tokens in
    # the training blocks, eos marks out of place). Reference: each split built from its own copy of its texts
    t = TokenizedTexts(np.arange(1, 21, dtype=np.int32), np.array([0, 5, 10, 15, 20]))
    train, val = TokenizedTexts(t.ids, t.offsets[:3]), TokenizedTexts(t.ids, t.offsets[2:])
    own_train = TokenizedTexts(np.arange(1, 11, dtype=np.int32), np.array([0, 5, 10]))
    own_val = TokenizedTexts(np.arange(11, 21, dtype=np.int32), np.array([0, 5, 10]))
    assert train.packed(4, eos_id=eos).tolist() == own_train.packed(4, eos_id=eos).tolist()
    assert val.packed(4, eos_id=eos).tolist() == own_val.packed(4, eos_id=eos).tolist()
    assert val.packed(5).tolist() == [[11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]


def test_packed_bad_arguments() -> None:
    t = TokenizedTexts(np.array([5, 6, 7], np.int32), np.array([0, 2, 3]))
    for kw, msg in [({"block_size": 0}, "block_size=0 must be an int >= 1"),
                    ({"block_size": 2.0}, "block_size=2.0"),
                    ({"block_size": 2, "eos_id": "</s>"}, "eos_id='</s>' must be an int token id"),
                    ({"block_size": 9}, "3 tokens make no block of block_size=9")]:
        with pytest.raises(UsageError, match=re.escape(msg)):
            t.packed(**kw)


@pytest.mark.parametrize("max_length", [None, 1, 3, 50])
def test_padded_equals_a_row_by_row_reference(max_length: int | None) -> None:
    """Reference: each text's ids copied into its row one by one (the loop padded() was); empty texts, texts cut at
    max_length, a view whose offsets do not start at 0, and no texts at all."""
    from overdrive.data.tokenize import TokenizedTexts

    rng = np.random.default_rng(0)
    lens = rng.integers(0, 9, size=40)
    lens[[3, 7]] = 0
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    texts = TokenizedTexts(rng.integers(1, 1000, size=int(lens.sum())).astype(np.int32), offsets)
    shifted = TokenizedTexts(texts.ids, offsets[5:])  # texts 5.. only
    for t in (texts, shifted, TokenizedTexts(np.zeros(0, np.int32), np.zeros(1, np.int64))):
        ids, mask = t.padded(pad_id=-1, max_length=max_length)
        n = len(t)
        L = max_length if max_length is not None else int(t.lengths().max() if n else 0)
        ref = torch.full((n, L), -1, dtype=torch.long)
        ref_mask = torch.zeros((n, L), dtype=torch.long)
        for i in range(n):
            row = torch.as_tensor(t[i][:L], dtype=torch.long)
            ref[i, :len(row)] = row
            ref_mask[i, :len(row)] = 1
        assert torch.equal(ids, ref) and torch.equal(mask, ref_mask)


def test_training_the_local_tokenizer_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    # the tokenizers library's trainer printed progress lines (blank lines off a terminal) into the demo's tables
    pytest.importorskip("tokenizers")
    from overdrive.data.tokenize import train_local_tokenizer

    train_local_tokenizer([f"sentence number {i} about fast tokenizers" for i in range(200)], vocab_size=120)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
