"""overdrive.data.read_texts: a text dataset on disk as the list of texts tokenize takes (reference: the texts
written, exactly)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from overdrive._utils.errors import UsageError
from overdrive.data import read_texts


def test_lines_folders_jsonl_and_gzip(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    # CRLF, a lone CR, a BOM, a blank line, no newline at the end; U+2028 and a form feed stay inside their text
    (tmp_path / "a.txt").write_bytes("\ufeffone\r\ntwo\rthree\u2028still three\n\n  \nfour\x0cfour".encode())
    with gzip.open(tmp_path / "sub" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for row in [{"text": "row one", "id": 1}, {"text": "row\ntwo\u2028", "id": 2}]:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (tmp_path / "notes.dat").write_text("ignored,1\n")  # not a text file by its name (.csv is: a column)
    assert read_texts(tmp_path) == ["one", "two", "three\u2028still three", "four\x0cfour", "row one",
                                    "row\ntwo\u2028"]
    assert read_texts(tmp_path / "a.txt", skip_empty=False) == ["one", "two", "three\u2028still three", "", "  ",
                                                                "four\x0cfour"]
    assert read_texts(tmp_path / "a.txt", per="file") == ["one\r\ntwo\rthree\u2028still three\n\n  \nfour\x0cfour"]


def test_jsonl_field_and_bad_rows(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"content": "a"}\n{"content": "b", "text": "x"}\n')
    assert read_texts(f, field="content") == ["a", "b"]
    with pytest.raises(UsageError, match=re.escape("d.jsonl: line 1 has no field 'text' (it has ['content'])")):
        read_texts(f)
    f.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(UsageError, match="line 2 is not JSON"):
        read_texts(f)
    f.write_text('{"text": 3}\n')
    with pytest.raises(UsageError, match="field 'text' is a int, expected a string"):
        read_texts(f)


def test_undecodable_bytes_named_or_replaced(tmp_path: Path) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(UsageError, match=r"latin1.txt: byte 6 \(line 2\) is not UTF-8"):
        read_texts(f)
    assert read_texts(f, errors="replace") == ["ok", "caf\ufffd"]


@pytest.mark.parametrize("kw,msg", [({"per": "doc"}, "per='doc'"), ({"errors": "surrogate"}, "errors='surrogate'")])
def test_bad_arguments(tmp_path: Path, kw: dict, msg: str) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(UsageError, match=re.escape(msg)):
        read_texts(tmp_path / "a.txt", **kw)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    with pytest.raises(UsageError, match="not a text file by its name"):
        read_texts(tmp_path / "data.parquet")
    with pytest.raises(UsageError, match="holds no text files"):
        read_texts(tmp_path)
    (tmp_path / "plain.txt.gz").write_bytes(b"not gzip\n")
    with pytest.raises(UsageError, match="plain.txt.gz: not a whole gzip file"):
        read_texts(tmp_path / "plain.txt.gz")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:40])
    with pytest.raises(UsageError, match="cut.jsonl.gz: not a whole gzip file"):
        read_texts(tmp_path / "cut.jsonl.gz")


def test_read_texts_feeds_tokenize(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from overdrive.data import tokenize

    (tmp_path / "a.txt").write_text("hello world\nhello there\n")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "world": 1, "there": 2, "[UNK]": 3},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    assert tokenize(read_texts(tmp_path), tok, num_workers=0)[:] == [[0, 1], [0, 2]]


def test_a_folder_of_texts_leaves_hidden_files_and_folders_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Jupyter checkpoint copy and a hidden file were read as texts of their own (duplicates in the corpus)."""
    from overdrive.data import read_texts

    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / "notes.txt").write_text("a\nb\n")
    (tmp_path / ".ipynb_checkpoints" / "notes-checkpoint.txt").write_text("a\nb\n")
    (tmp_path / ".hidden.txt").write_text("x\n")
    assert read_texts(tmp_path) == ["a", "b"]
