"""tokenize's disk cache: pruned least-recently-used first, and never stale when the tokenizer or its settings change."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

tk = pytest.importorskip("tokenizers")

from overdrive._utils.errors import UsageError  # noqa: E402
from overdrive.data import prune_token_cache, tokenize  # noqa: E402


def _tokenizer() -> object:
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "b": 4, "c": 5, "hello": 6, "world": 7}
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.post_processor = tk.processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return tok


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.suffix == ".npz")


def _age(d: Path, seconds_ago: dict[str, int]) -> None:
    """Set each cache file's last use ``seconds_ago`` (deterministic: no sleeps)."""
    for name, ago in seconds_ago.items():
        t = 1_700_000_000 - ago
        os.utime(d / name, (t, t))


def test_cache_max_bytes_keeps_the_newest_and_drops_the_least_recently_used(tmp_path: Path) -> None:
    tok = _tokenizer()
    lists = [["a b c " * 50 + str(i)] * 20 for i in range(4)]
    names = []
    for texts in lists:
        before = set(_files(tmp_path))
        tokenize(texts, tok, cache_dir=tmp_path, num_workers=0)
        (new,) = set(_files(tmp_path)) - before
        names.append(new)
    size = (tmp_path / names[0]).stat().st_size
    _age(tmp_path, {names[0]: 400, names[1]: 300, names[2]: 200, names[3]: 100})
    hit = tokenize(lists[0], tok, cache_dir=tmp_path, num_workers=0)  # a hit renews list 0: now the most recent
    assert hit.from_cache
    out = tokenize(["hello world"], tok, cache_dir=tmp_path, num_workers=0, cache_max_bytes=2 * size + 1000)
    assert out[0] == tok.encode("hello world").ids
    left = _files(tmp_path)
    assert names[0] in left and names[1] not in left and names[2] not in left  # 1 and 2 were used least recently
    assert len(left) == 3 and sum((tmp_path / n).stat().st_size for n in left) > 2 * size  # the new one is kept
    assert tokenize(lists[0], tok, cache_dir=tmp_path, num_workers=0).from_cache
    assert not tokenize(lists[1], tok, cache_dir=tmp_path, num_workers=0).from_cache


def test_prune_leaves_other_files_alone(tmp_path: Path) -> None:
    tokenize(["a b"], _tokenizer(), cache_dir=tmp_path, num_workers=0)
    (tmp_path / "notes.npz").write_bytes(b"x" * 10_000)
    (tmp_path / "README").write_text("mine")
    removed = prune_token_cache(tmp_path, 0)
    assert len(removed) == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["README", "notes.npz"]


@pytest.mark.parametrize("bad", [-1, 1.5, "10G", True])
def test_bad_sizes_are_named(tmp_path: Path, bad: object) -> None:
    with pytest.raises(UsageError, match=r"max_bytes="):
        prune_token_cache(tmp_path, bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"cache_max_bytes="):
        tokenize(["a"], _tokenizer(), cache_dir=tmp_path, cache_max_bytes=bad)  # type: ignore[arg-type]


def test_cache_max_bytes_without_cache_dir_is_refused() -> None:
    with pytest.raises(UsageError, match="cache_dir"):
        tokenize(["a"], _tokenizer(), cache_max_bytes=1000)


def test_prune_of_a_missing_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="nope"):
        prune_token_cache(tmp_path / "nope", 10)


def test_no_stale_hit_when_the_tokenizer_or_its_settings_change(tmp_path: Path) -> None:
    texts = ["hello world", "a b c", "", "héllo 🙂 world"]
    tok = _tokenizer()
    variants = [
        lambda t: None,
        lambda t: setattr(t, "normalizer", tk.normalizers.Lowercase()),
        lambda t: t.add_tokens(["héllo"]),
        lambda t: t.enable_truncation(3),
        lambda t: t.enable_truncation(3, direction="left"),
        lambda t: t.enable_padding(pad_id=0, length=6),
        lambda t: setattr(t, "post_processor", None),
    ]
    for change in variants:
        change(tok)
        out = tokenize(texts, tok, cache_dir=tmp_path, num_workers=0)
        assert not out.from_cache
        assert [out[i] for i in range(len(texts))] == [tok.encode(t).ids for t in texts]
        again = tokenize(texts, tok, cache_dir=tmp_path, num_workers=0)
        assert again.from_cache and [again[i] for i in range(len(texts))] == [out[i] for i in range(len(texts))]

