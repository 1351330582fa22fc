"""`overdrive build --int8 --calib` for models whose inputs go by name: a T5 (input_ids and decoder_input_ids, not
forward's first two parameters), a BERT calibrated on `torch.save(list(loader))` of a tokenized dataset (labels and
token_type_ids the engine does not take), a two-input float model; and calibration data that does not fit, refused
before the export with the flag, the value and the fix."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive.cli.main import main

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

MODELS = textwrap.dedent("""
    import torch
    from torch import nn

    def make_bert():
        from transformers import BertConfig, BertModel
        torch.manual_seed(0)
        return BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, max_position_embeddings=64)).eval()

    def make_t5():
        from transformers import T5Config, T5Model
        torch.manual_seed(0)
        return T5Model(T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=2, decoder_start_token_id=0, pad_token_id=0)).eval()

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 8)

        def forward(self, x, y):
            return self.c(torch.relu(self.a(x) + self.b(y)))

    def make_two():
        return Two().eval()
""")


def _tokens(n: int, t: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (n, t) with a tail of padding (id 0) of varied length, and the attention_mask a tokenizer gives."""
    g = np.random.default_rng(seed)
    ids = g.integers(1, 100, size=(n, t))
    lengths = g.integers(t // 2, t + 1, size=n)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int64)
    return ids * mask, mask


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _build(*args: str) -> list[str]:
    return ["build", "--backend", "onnxruntime", "--int8", "--no-progress", "--save-engine", "m.engine",
            "--json", "info.json", *args]


def _accuracy(workdir: Path) -> dict:
    return json.loads((workdir / "info.json").read_text())["accuracy"]


def test_t5_is_calibrated_and_judged_by_its_input_names(workdir: Path) -> None:
    ids, _ = _tokens(32, 16, 0)
    dec, _ = _tokens(32, 8, 1)
    np.savez("t5.npz", input_ids=ids, decoder_input_ids=dec)
    assert main(_build("--model", "models.py:make_t5", "--shapes", "input_ids:4x16,decoder_input_ids:4x8",
                       "--calib", "t5.npz")) == 0
    acc = _accuracy(workdir)
    assert acc["on"].startswith("calibration data") and acc["passed"] and acc["cosine"] >= 0.99
    from overdrive.engine import Engine

    engine = Engine.load("m.engine")
    assert [i["name"] for i in engine.info["inputs"]] == ["input_ids", "decoder_input_ids"]
    import importlib.util

    spec = importlib.util.spec_from_file_location("calib_models_t5", workdir / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)  # type: ignore[union-attr]
    x, d = torch.from_numpy(ids[:4]), torch.from_numpy(dec[:4])
    with torch.no_grad():
        want = models.make_t5()(input_ids=x, decoder_input_ids=d).last_hidden_state  # (4, 8, 32)
    got = engine(input_ids=x, decoder_input_ids=d)["last_hidden_state"]
    assert torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min() >= 0.99


def test_dataloader_dicts_with_labels_leave_out_what_the_engine_does_not_take(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids, mask = _tokens(32, 16, 2)
    loader = [{"input_ids": torch.from_numpy(ids[i:i + 4]), "attention_mask": torch.from_numpy(mask[i:i + 4]),
               "token_type_ids": torch.zeros(4, 16, dtype=torch.long), "labels": torch.randint(0, 2, (4,))}
              for i in range(0, 32, 4)]
    torch.save(loader, "calib.pt")
    # batches of 4 for an engine of batch 8: joined and cut to it
    assert main(_build("--model", "models.py:make_bert", "--shapes", "input_ids:8x16,attention_mask:8x16",
                       "--calib", "calib.pt")) == 0
    err = capsys.readouterr().err
    assert "left out ['token_type_ids', 'labels']" in err and "--shapes" in err
    acc = _accuracy(workdir)
    assert acc["on"].startswith("calibration data") and acc["passed"] and acc["cosine"] >= 0.99


def test_two_float_inputs_by_name_on_a_dynamic_profile(workdir: Path) -> None:
    g = np.random.default_rng(3)
    np.savez("two.npz", y=g.standard_normal((40, 16)).astype(np.float32),
             x=g.standard_normal((40, 16)).astype(np.float32))  # not forward's order: read by name
    assert main(_build("--model", "models.py:make_two", "--minShapes", "x:1x16,y:1x16", "--optShapes",
                       "x:4x16,y:4x16", "--maxShapes", "x:8x16,y:8x16", "--calib", "two.npz")) == 0
    acc = _accuracy(workdir)
    assert acc["passed"] and acc["cosine"] >= 0.99


def _refused_before_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.recipes import build

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the build ran before the calibration data was checked")

    monkeypatch.setattr(build.Builder, "build", never)


def test_float_token_ids_are_refused_naming_the_input_and_the_fix(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ids, mask = _tokens(8, 16, 4)
    np.savez("calib.npz", input_ids=ids.astype(np.float32), attention_mask=mask)
    _refused_before_the_build(monkeypatch)
    assert main(_build("--model", "models.py:make_bert", "--shapes", "input_ids:4x16,attention_mask:4x16",
                       "--calib", "calib.npz")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'input_ids' is float32" in err and "int64" in err and "astype(np.int64)" in err


def test_sequence_lengths_outside_static_shapes_are_refused_before_the_build(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    batches = []
    for k, t in enumerate((16, 12)):  # padded per batch, as DataCollatorWithPadding does
        ids, mask = _tokens(4, t, 5 + k)
        batches.append({"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)})
    torch.save(batches, "calib.pt")
    _refused_before_the_build(monkeypatch)
    assert main(_build("--model", "models.py:make_bert", "--shapes", "input_ids:4x16,attention_mask:4x16",
                       "--calib", "calib.pt")) == 2
    err = capsys.readouterr().err.strip()
    assert "batch 1's input 'input_ids' is 4x12" in err and "--shapes input_ids:4x16 fixes it at (N, 16)" in err
    assert "--minShapes" in err
    assert main(_build("--model", "models.py:make_bert", "--minShapes", "input_ids:1x4,attention_mask:1x4",
                       "--optShapes", "input_ids:4x8,attention_mask:4x8", "--maxShapes",
                       "input_ids:4x8,attention_mask:4x8", "--calib", "calib.pt")) == 2
    assert "the profile takes 4 to 8 past the batch dim" in capsys.readouterr().err


def test_a_leading_batch_of_batches_dim_is_refused_with_the_reshape(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ids, mask = _tokens(32, 16, 7)
    np.savez("calib.npz", input_ids=ids.reshape(8, 4, 16), attention_mask=mask.reshape(8, 4, 16))
    _refused_before_the_build(monkeypatch)
    assert main(_build("--model", "models.py:make_bert", "--shapes", "input_ids:4x16,attention_mask:4x16",
                       "--calib", "calib.npz")) == 2
    err = capsys.readouterr().err
    assert "'input_ids' is 8x4x16" in err and "input_ids.reshape(-1, *input_ids.shape[2:])" in err
