"""--input-shape of quantize and sparsify in any rank and by name (token ids), and calibration files of
matching shape: a tabular MLP, a sequence model, a token model; errors are one line, before calibrating."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.recipes.input_shapes import example_inputs, parse_input_shapes, positional

MODELS = '''
import torch
from torch import nn

class Tagger(nn.Module):  # token model: (B, T) ids -> (B, T, 8)
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.fc(h)

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

def tagger():
    torch.manual_seed(0)
    return Tagger()
'''


@pytest.fixture
def files(tmp_path: Path) -> Path:
    folder = tmp_path / "my files"  # a space in every path
    folder.mkdir()
    (folder / "models.py").write_text(MODELS)
    rng = np.random.default_rng(0)
    np.save(folder / "tabular.npy", rng.standard_normal((32, 16), dtype=np.float32))
    np.savez(folder / "tokens.npz", input_ids=rng.integers(1, 50, (16, 8)))
    return folder


def test_parse_any_rank_and_names() -> None:
    assert parse_input_shapes("1,16") == {None: (1, 16)}
    assert parse_input_shapes("2x5x16") == {None: (2, 5, 16)}
    assert parse_input_shapes("input_ids:1x8,attention_mask:1x8") == {"input_ids": (1, 8), "attention_mask": (1, 8)}
    for bad in ("1,a", "0,16", "x:1xq"):
        with pytest.raises(UsageError, match="--input-shape"):
            parse_input_shapes(bad)


def test_token_examples_are_ids_below_the_vocabulary(files: Path) -> None:
    from overdrive.recipes.model_spec import load_model

    model = load_model(f"{files / 'models.py'}:tagger")
    x = example_inputs(model, {"input_ids": (2, 8), "token_type_ids": (2, 8)})
    assert x["input_ids"].dtype == torch.int64 and int(x["input_ids"].max()) < 50
    args = positional(model, x, "input_ids:2x8,token_type_ids:2x8")
    assert args[1] is None and args[2] is x["token_type_ids"]  # attention_mask skipped, by position
    assert model(*args).shape == (2, 8, 8)


def test_quantize_a_2d_mlp_from_npy(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["quantize", "--model", f"{files / 'models.py'}:mlp", "--calib-data", str(files / "tabular.npy"),
                 "--input-shape", "1,16", "--save", str(files / "q m.pt"), "--no-progress"])
    assert code in (0, None), capsys.readouterr().err
    assert (files / "q m.pt").is_file()


def test_quantize_a_token_model_by_name(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["quantize", "--model", f"{files / 'models.py'}:tagger", "--calib-data", str(files / "tokens.npz"),
                 "--input-shape", "input_ids:1x8", "--no-progress"])
    assert code in (0, None), capsys.readouterr().err
    assert "QuantLinear" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--input-shape", "1,15"], "--input-shape 1,15 says its input is (N, 15) but --calib-data"),
    (["--input-shape", "1,4,16"], "holds batches of (32, 16)"),
    (["--input-shape", "input_ids:1x8,attention_mask:1x8"], "names ['attention_mask'] but --calib-data"),
])
def test_quantize_calibration_of_another_shape_is_one_line(files: Path, capsys: pytest.CaptureFixture[str],
                                                           args: list[str], message: str) -> None:
    calib = "tokens.npz" if "input_ids" in args[1] else "tabular.npy"
    model = "tagger" if "input_ids" in args[1] else "mlp"
    code = main(["quantize", "--model", f"{files / 'models.py'}:{model}", "--calib-data", str(files / calib),
                 *args, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_quantize_refuses_digits_images_for_another_model(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", "--model", f"{files / 'models.py'}:mlp", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--calib-data digits (the default)" in err and "calib.npy" in err and "fails on calibration" not in err


def test_image_folder_needs_an_image_shape(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (files / "imgs").mkdir()
    assert main(["quantize", "--model", f"{files / 'models.py'}:mlp", "--calib-data", str(files / "imgs"),
                 "--input-shape", "1,16", "--no-progress"]) == 2
    assert "image folder but --input-shape 1,16 has 2 dims" in capsys.readouterr().err


@pytest.mark.parametrize("model, shape", [("mlp", "1,16"), ("mlp", "x:1x16"), ("tagger", "1,8"),
                                          ("tagger", "input_ids:1x8,attention_mask:1x8")])
def test_sparsify_reports_flops_for_any_input(files: Path, capsys: pytest.CaptureFixture[str], model: str,
                                              shape: str) -> None:
    out = files / f"{model}.sparse24.pt"
    code = main(["sparsify", "--model", f"{files / 'models.py'}:{model}", "--allow-untrained", "--out", str(out),
                 "--input-shape", shape, "--json", "-"])
    assert code in (0, None), capsys.readouterr().err
    import json

    report = json.loads(capsys.readouterr().out)["report"]
    assert report["flop_fraction_pruned"] > 0


def test_sparsify_unknown_input_name_is_one_line(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sparsify", "--model", f"{files / 'models.py'}:tagger", "--allow-untrained", "--out",
                 str(files / "t.pt"), "--input-shape", "ids:1x8,mask:1x8"]) == 2
    err = capsys.readouterr().err
    assert "names ['ids', 'mask'] but Tagger.forward takes ['input_ids'" in err and not (files / "t.pt").exists()
