"""Text datasets as users have them on disk: CSV/TSV columns, nested JSON Lines fields, the byte and line named for
bytes that are not UTF-8 after a BOM, and `overdrive data tokenize` on files and folders (reference: Python's csv
module for the tables, the transformers tokenizer called directly for the ids)."""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest

from overdrive._utils.errors import UsageError
from overdrive.data import read_texts


def test_bad_byte_after_a_bom_is_named_at_its_byte_and_line(tmp_path: Path) -> None:
    """The "utf-8-sig" codec counts positions after the BOM: the byte was named 3 too early and a bad byte at a line's
    start was put on the line before."""
    p = tmp_path / "a.txt"
    p.write_bytes(b"\xef\xbb\xbfab\n\xff\n")
    with pytest.raises(UsageError, match=r"a\.txt: byte 6 \(line 2\) is not UTF-8"):
        read_texts(p)
    assert read_texts(p, errors="replace") == ["ab", "\ufffd"]


def test_csv_and_tsv_columns_equal_pythons_csv_module(tmp_path: Path) -> None:
    rows = [["1", "multi\nline, with \"quotes\"", "x"], ["2", "plain", ""], ["3", "", "y"], ["4", "crlf\r\ninside", "z"]]
    for name, delim in (("a.csv", ","), ("b.tsv.gz", "\t")):
        buf = io.StringIO(newline="")
        w = csv.writer(buf, delimiter=delim, lineterminator="\r\n")  # Windows line ends between rows
        w.writerows([["id", "body", "note"], *rows])
        data = ("\ufeff" + buf.getvalue()).encode()
        (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        ref = [r[1] for r in csv.reader(io.StringIO(buf.getvalue(), newline=""), delimiter=delim)][1:]
        assert read_texts(tmp_path / name, field="body", skip_empty=False) == ref
        assert read_texts(tmp_path / name, field="body") == [t for t in ref if t.strip()]
    with pytest.raises(UsageError, match=r"a\.csv: no column 'text' in the header row \(columns: \['id', 'body', "
                                         r"'note'\]\); pass field="):
        read_texts(tmp_path / "a.csv")


def test_csv_short_row_and_long_cell(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text("id,note,text\n1,a,fine\n2,b\n")
    with pytest.raises(UsageError, match=r"a\.csv: line 3 has 2 cells, no 'text' \(column 3 of 3\)"):
        read_texts(p)
    long = "word " * 40_000  # 200 kB: over csv's default 128 KiB field limit
    p.write_text(f'text\n"{long}"\nshort\n')
    limit = csv.field_size_limit()
    assert read_texts(p) == [long, "short"]
    assert csv.field_size_limit() == limit  # put back: the limit is process-wide


def test_nested_jsonl_field(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"meta": {"body": "nested"}, "a.b": "dotted key"}) + "\n")
    assert read_texts(p, field="meta.body") == ["nested"]
    assert read_texts(p, field="a.b") == ["dotted key"]  # a key with a dot wins over the walk
    with pytest.raises(UsageError, match=r"line 1 has no field 'meta.title' \(it has \['body'\]\)"):
        read_texts(p, field="meta.title")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    from overdrive.data.tokenize import local_corpus, train_local_tokenizer

    tok = train_local_tokenizer(local_corpus(5)[:200], vocab_size=300)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tok.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                              cls_token="[CLS]", sep_token="[SEP]", truncation_side="left")
    hf.save_pretrained(d / "hf")
    return d


def test_cli_tokenize_equals_the_tokenizer_called_directly(tmp_path: Path, hf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from overdrive.cli.main import main

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(b"\xef\xbb\xbfhello world, a longer line of text\r\n\r\nshort\r\nlast")
    (tmp_path / "d" / "b.csv").write_text('id,text\n1,"two\nlines of text"\n')
    texts = ["hello world, a longer line of text", "short", "last", "two\nlines of text"]
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir / "hf")
    out, cache = tmp_path / "t.npz", tmp_path / "cache"
    args = ["data", "tokenize", str(tmp_path / "d"), "-t", str(hf_dir / "hf"), "--max-length", "5", "--workers",
            "0", "--cache-dir", str(cache), "-o", str(out), "--json", str(tmp_path / "s.json")]
    for _ in range(2):  # the second from the cache
        assert main(args) == 0
        z = np.load(out)
        got = [z["ids"][a:b].tolist() for a, b in zip(z["offsets"][:-1], z["offsets"][1:])]
        assert got == hf(texts, truncation=True, max_length=5)["input_ids"]
    assert json.loads((tmp_path / "s.json").read_text())["from_cache"] is True
    (tmp_path / "d" / "a.txt").write_text("changed")  # a changed file: tokenized anew, not the stale entry
    assert main(args) == 0
    assert json.loads((tmp_path / "s.json").read_text())["from_cache"] is False
    z = np.load(out)
    assert z["ids"][: z["offsets"][1]].tolist() == hf("changed", truncation=True, max_length=5)["input_ids"]


def test_cli_tokenize_refusals(tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from overdrive.cli.main import main

    (tmp_path / "e.txt").write_text("\n\n")
    (tmp_path / "c.csv").write_text("id,body\n1,x\n")
    tok = str(hf_dir / "tok.json")
    assert main(["data", "tokenize", str(tmp_path / "e.txt"), "-t", tok]) == 2
    assert "no texts" in capsys.readouterr().err
    assert main(["data", "tokenize", str(tmp_path / "c.csv"), "-t", tok, "--field", "text"]) == 2
    assert "no column 'text'" in capsys.readouterr().err
    assert main(["data", "tokenize", str(tmp_path / "c.csv"), "-t", str(tmp_path)]) == 2  # a folder, no tokenizer.json
    assert "holds no tokenizer.json" in capsys.readouterr().err
    assert main(["data", "tokenize", str(tmp_path / "c.csv"), "-t", tok, "--field", "body", "-o",
                 str(tmp_path / "x.txt")]) == 2
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_file_with_a_utf16_or_utf32_bom_is_read_in_that_encoding(tmp_path: Path, encoding: str) -> None:
    """Windows tools (Notepad's "Unicode", PowerShell 5's > and Out-File) write UTF-16 with a BOM: read as UTF-8 it was
    refused, and with errors='replace' read as texts of U+FFFD and NUL characters."""
    p = tmp_path / "win.txt"
    bom = {"utf-16-be": "\ufeff"}.get(encoding, "")  # "utf-16"/"utf-32" write their BOM themselves
    p.write_bytes((bom + "café line\r\n\r\nsecond ü\r\n").encode(encoding))
    for errors in ("strict", "replace"):
        assert read_texts(p, errors=errors) == ["café line", "second ü"]
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes('{"text": "ä row"}\n'.encode("utf-16"))
    assert read_texts(rows) == ["ä row"]
    bad = tmp_path / "bad.txt"  # a lone low surrogate on line 2: named at its byte and line, in its encoding
    bad.write_bytes("a\n".encode("utf-16") + b"\x00\xdcb\x00")
    with pytest.raises(UsageError, match=r"bad\.txt: byte 6 \(line 2\) is not UTF-16"):
        read_texts(bad)


def test_many_sources_and_glob_patterns(tmp_path: Path) -> None:
    """A shell's shards/*.jsonl hands over many paths, and a quoted pattern reaches read_texts as it is: both were
    refused (one SOURCE only; the pattern "does not exist")."""
    from overdrive.cli.main import main

    (tmp_path / "shards" / "sub").mkdir(parents=True)
    for name, rows in (("b-1.jsonl", ["b1"]), ("a-0.jsonl", ["a0", "a0'"]), ("sub/c.jsonl", ["c"])):
        (tmp_path / "shards" / name).write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    (tmp_path / "shards" / "notes.parquet").write_bytes(b"PAR1")  # not text: left out, as in a folder
    (tmp_path / "extra.txt").write_text("x\n")
    shards = tmp_path / "shards"
    assert read_texts(shards / "*.jsonl") == ["a0", "a0'", "b1"]  # sorted
    assert read_texts(str(shards / "**" / "*.jsonl")) == ["a0", "a0'", "b1", "c"]
    assert read_texts([tmp_path / "extra.txt", shards / "b-1.jsonl", shards / "*-0.jsonl"]) == ["x", "b1", "a0", "a0'"]
    with pytest.raises(UsageError, match=r"pattern '.*\*\.csv' matches nothing"):
        read_texts(shards / "*.csv")
    with pytest.raises(UsageError, match=r"pattern '.*\*\.parquet' matches 1 path\(s\) but no text file"):
        read_texts(shards / "*.parquet")
    with pytest.raises(UsageError, match=r"a non-empty list"):
        read_texts([])

    tok = pytest.importorskip("tokenizers")
    t = tok.Tokenizer(tok.models.WordLevel({"[UNK]": 0, "a0": 1, "b1": 2, "x": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = tok.pre_tokenizers.WhitespaceSplit()
    t.save(str(tmp_path / "tok.json"))
    out = tmp_path / "t.npz"
    assert main(["data", "tokenize", str(tmp_path / "extra.txt"), str(shards / "b-1.jsonl"), str(shards / "a-0.jsonl"),
                 "-t", str(tmp_path / "tok.json"), "-o", str(out), "--json", str(tmp_path / "s.json")]) == 0
    z = np.load(out)
    assert z["ids"].tolist() == [3, 2, 1, 0] and z["offsets"].tolist() == [0, 1, 2, 3, 4]
    assert json.loads((tmp_path / "s.json").read_text())["source"] == [str(tmp_path / "extra.txt"),
                                                                        str(shards / "b-1.jsonl"),
                                                                        str(shards / "a-0.jsonl")]


def test_jsonl_list_items_and_bom_inside_a_joined_file(tmp_path: Path) -> None:
    """Chat rows keep their text in a list ("messages.0.content"), which the walk refused ("it has list"); a file
    joined from files that each began with a BOM (cat a.jsonl b.jsonl) has one at a line start, which json refuses."""
    p = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "one"}]}]
    p.write_bytes(b"".join(b"\xef\xbb\xbf" + json.dumps(r).encode() + b"\n" for r in rows))
    assert read_texts(p, field="messages.0.content") == ["hi", "one"]
    assert read_texts(p, field="messages.-1.content") == ["hello", "one"]
    with pytest.raises(UsageError, match=r"line 2 has no field 'messages.1.content' \(it has a list of 1 item\(s\), "
                                         r"indexed 0..0\)"):
        read_texts(p, field="messages.1.content")


def test_linked_folders_are_read_and_a_link_to_a_folder_above_does_not_loop(tmp_path: Path) -> None:
    """A corpus assembled from links to shard folders elsewhere: Path.rglob (before Python 3.13) does not enter a
    linked folder, and its texts were silently left out."""
    elsewhere, corpus = tmp_path / "disk2" / "wiki", tmp_path / "corpus"
    elsewhere.mkdir(parents=True)
    corpus.mkdir()
    (elsewhere / "w.txt").write_text("from the linked shard\n")
    (corpus / "own.txt").write_text("own text\n")
    (corpus / "wiki").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "back").symlink_to(corpus, target_is_directory=True)  # a loop: corpus/wiki/back is corpus
    (corpus / "gone.txt").symlink_to(tmp_path / "missing.txt")  # dangling: not a file, left out as in a listing
    assert read_texts(corpus) == ["own text", "from the linked shard"]
    assert read_texts(corpus / "**") == ["own text", "from the linked shard"]  # folders and files matched: each once
