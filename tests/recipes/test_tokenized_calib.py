"""The .npz that ``overdrive data tokenize -o`` writes (texts stored flat: ids + offsets) as calibration data for
``overdrive quantize --calib-data`` and ``overdrive build --calib``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.data import TokenizedTexts
from overdrive.recipes.calibration import load_calibration

# three texts of 3, 1 and 2 tokens, stored flat as TokenizedTexts.save writes them
IDS = np.array([5, 6, 7, 8, 9, 10], np.int32)
OFFSETS = np.array([0, 3, 4, 6], np.int64)

MODEL_FILE = '''
import torch
from torch import nn

class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(32, 16), nn.Linear(16, 4)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.fc(h)
'''


class Masked(nn.Module):
    def __init__(self, pad: int | None) -> None:
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=pad)
        self.emb = nn.Embedding(32, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.emb(input_ids)


class IdsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids)


@pytest.fixture()
def tokens(tmp_path: Path) -> Path:
    return TokenizedTexts(IDS, OFFSETS).save(tmp_path / "tokens.npz")


def test_tokenized_npz_is_padded_ids_and_mask(tokens: Path) -> None:
    calib = load_calibration(str(tokens), "--calib-data", batch_size=8, model=Masked(pad=1))
    assert calib.names == ("input_ids", "attention_mask")
    ids, mask = calib.batches[0]
    assert ids.tolist() == [[5, 6, 7], [8, 1, 1], [9, 10, 1]]  # right-padded with the config's pad id
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]  # the texts' lengths, not ids != pad
    assert ids.dtype == torch.int64


def test_tokenized_npz_takes_the_sequence_length_given(tokens: Path) -> None:
    ids, mask = load_calibration(str(tokens), "--calib-data", model=Masked(pad=None), input_shape=(1, 5)).batches[0]
    assert ids.shape == mask.shape == (3, 5)
    assert ids[1].tolist() == [8, 0, 0, 0, 0]  # no pad id in the config: 0, masked out
    cut = load_calibration(str(tokens), "--calib-data", model=Masked(pad=0), input_shape=(1, 2)).batches[0][0]
    assert cut.tolist() == [[5, 6], [8, 0], [9, 10]]  # longer texts keep their first tokens


def test_tokenized_npz_without_mask_for_a_model_that_takes_none(tokens: Path) -> None:
    calib = load_calibration(str(tokens), "--calib-data", batch_size=2, model=IdsOnly())
    assert calib.names == ("input_ids",)
    assert [tuple(b[0].shape) for b in calib.batches] == [(2, 3), (1, 3)]
    engine = load_calibration(str(tokens), "--calib", input_names=["input_ids", "attention_mask"])
    assert engine.names == ("input_ids", "attention_mask")


def test_tokenized_npz_that_is_not_a_corpus_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, ids=IDS, offsets=np.array([0, 3, 2, 6]))
    with pytest.raises(UsageError, match="not a tokenized corpus"):
        load_calibration(str(bad), "--calib-data", model=Masked(pad=0))


def test_quantize_verb_takes_data_tokenize_output(tmp_path: Path, tokens: Path) -> None:
    (tmp_path / "tagger.py").write_text(MODEL_FILE)
    out = tmp_path / "summary.json"
    code = main(["quantize", "--model", f"{tmp_path / 'tagger.py'}:Tagger", "--calib-data", str(tokens),
                 "--input-shape", "input_ids:1x8", "--no-progress", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert {r["name"] for r in result["layers"]} >= {"fc"}
    assert result["fidelity"]["cosine"] > 0.99


class _TokenModel(nn.Module):
    """A token model with a 50-token vocabulary (an embedding and a head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 8), nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.emb(input_ids).mean(1))


@pytest.mark.parametrize("bad", [50, 999, -3])
def test_token_ids_outside_the_vocabulary_are_named_before_the_model_runs(tmp_path, bad: int) -> None:
    """Data tokenized with another tokenizer: the model failed mid-calibration with a bare IndexError."""
    ids = torch.randint(0, 50, (8, 6))
    ids[3, 2] = bad
    path = tmp_path / "calib.pt"
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path)
    with pytest.raises(UsageError, match=rf"input_ids holds token id {bad}, but _TokenModel's vocabulary has 50 "
                                         r"tokens \(ids 0\.\.49\).*tokenize it with the model's own"):
        load_calibration(str(path), "--calib-data", model=_TokenModel())
    ids[3, 2] = 49  # the last id is in range
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path)
    calib = load_calibration(str(path), "--calib-data", model=_TokenModel())
    assert calib.names == ("input_ids", "attention_mask") and int(calib.batches[0][0].max()) == 49
