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
