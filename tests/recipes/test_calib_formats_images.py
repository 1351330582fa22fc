"""Calibration from an image folder or a text file, and factory arguments in a model spec, through the verbs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.model_spec import load_factory, split_call
from overdrive.recipes.calib_formats import ImageOptions, parse_input_shape, parse_normalize, read_image_folder
from overdrive.recipes.calibration import load_calibration

NET_PY = '''import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, num_classes=10, width=8):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def make_model(num_classes=10, width=8):
    torch.manual_seed(0)
    return Net(num_classes, width).eval()
'''


def _folder(root: Path, flat: bool = False, n: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for c in ("" if flat else "b_dog", "" if flat else "a_cat"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            ext = "png" if i % 2 else "jpg"
            Image.fromarray(rng.integers(0, 256, (30 + i, 50, 3), dtype=np.uint8)).save(root / c / f"{i}.{ext}")
    return root


def test_solid_colour_is_normalized_exactly(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (64, 48), (255, 0, 128)).save(tmp_path / "imgs" / "x.png")  # lossless: exact pixels
    x = read_image_folder(str(tmp_path / "imgs"), "--calib", ImageOptions(input_shape=(3, 16, 16)))
    want = (torch.tensor([1.0, 0.0, 128 / 255]) - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    assert x.shape == (1, 3, 16, 16) and x.dtype == torch.float32
    torch.testing.assert_close(x[0].mean((1, 2)), want, atol=1e-5, rtol=0)
    none = read_image_folder(str(tmp_path / "imgs"), "--calib", ImageOptions((3, 8, 12), normalize="none"))
    assert none.shape == (1, 3, 8, 12) and float(none[0, 0].min()) == pytest.approx(1.0)


def test_center_crop_keeps_the_middle(tmp_path: Path) -> None:
    """A wide image: left and right thirds black, middle white; the center crop of a square sees white only."""
    a = np.zeros((60, 180, 3), np.uint8)
    a[:, 60:120] = 255
    (tmp_path / "i").mkdir()
    Image.fromarray(a).save(tmp_path / "i" / "w.png")
    x = read_image_folder(str(tmp_path / "i"), "--calib", ImageOptions((3, 20, 20), normalize="none", crop_fraction=1.0))
    assert float(x[..., 2:-2].min()) > 0.99 and float(x.mean()) > 0.95  # the edges blend in the antialiased resize


def test_order_is_deterministic_and_spans_classes(tmp_path: Path) -> None:
    root = _folder(tmp_path / "imgs")
    opts = ImageOptions((3, 8, 8), samples=2)
    a = read_image_folder(str(root), "--calib", opts)
    b = read_image_folder(str(root), "--calib", opts)
    assert torch.equal(a, b) and len(a) == 2
    full = read_image_folder(str(root), "--calib", ImageOptions((3, 8, 8)))
    assert len(full) == 8
    torch.testing.assert_close(a, full[[0, 4]])  # evenly spaced: the first image of each class


def test_flat_folder_gray_model_and_batches(tmp_path: Path) -> None:
    root = _folder(tmp_path / "flat", flat=True, n=5)
    calib = load_calibration(str(root), "--calib", batch_size=2, images=ImageOptions((1, 1, 8, 8)))
    assert [tuple(b[0].shape) for b in calib.batches] == [(2, 1, 8, 8), (2, 1, 8, 8), (1, 1, 8, 8)]


def test_timm_pretrained_cfg_gives_size_and_normalization(tmp_path: Path) -> None:
    root = _folder(tmp_path / "imgs", n=1)
    model = nn.Conv2d(3, 4, 3)
    model.pretrained_cfg = {"input_size": (3, 12, 10), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "crop_pct": 1.0}
    x = read_image_folder(str(root), "--calib", ImageOptions(), model=model)
    assert x.shape == (2, 3, 12, 10) and float(x.min()) >= -1.0 - 1e-6 and float(x.max()) <= 1.0 + 1e-6


def test_errors_name_the_fix(tmp_path: Path) -> None:
    root = _folder(tmp_path / "imgs", n=1)
    with pytest.raises(UsageError, match="--input-shape 1,3,224,224"):
        read_image_folder(str(root), "--calib", ImageOptions())
    with pytest.raises(UsageError, match="MEAN:STD"):
        parse_normalize("0.5,0.5")
    with pytest.raises(UsageError, match="std must be > 0"):
        parse_normalize("0:0")
    with pytest.raises(UsageError, match="4 channels"):
        read_image_folder(str(root), "--calib", ImageOptions((4, 8, 8)))
    with pytest.raises(UsageError, match="give one value or 1"):
        read_image_folder(str(root), "--calib", ImageOptions((1, 8, 8), normalize="0.1,0.2,0.3:1,1,1"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no images"):
        read_image_folder(str(tmp_path / "empty"), "--calib", ImageOptions((3, 8, 8)))
    with pytest.raises(UsageError, match="comma-separated"):
        parse_input_shape("1,3,a")
    (root / "a_cat" / "broken.jpg").write_bytes(b"not an image")
    with pytest.warns(UserWarning, match="skipped 1 image"):
        assert len(read_image_folder(str(root), "--calib", ImageOptions((3, 8, 8)))) == 2


def test_text_file(tmp_path: Path) -> None:
    from overdrive.recipes.textdata import SEQ, ByteTransformer

    p = tmp_path / "lines.txt"
    p.write_text("hello\n\nworld " * 1 + "\n" + "x" * 100 + "\n", encoding="utf-8")
    calib = load_calibration(str(p), "--calib-data", model=ByteTransformer())
    ids = calib.batches[0][0]
    assert ids.shape == (3, SEQ) and ids.dtype == torch.int64
    assert ids[0, :5].tolist() == [c + 1 for c in b"hello"] and int(ids[0, 5]) == 0
    with pytest.raises(UsageError, match="knows no tokenizer for Linear.*torch.save"):
        load_calibration(str(p), "--calib-data", model=nn.Linear(2, 2))


def test_factory_arguments(tmp_path: Path) -> None:
    (tmp_path / "net.py").write_text(NET_PY)
    spec = str(tmp_path / "net.py")
    assert split_call(f"{spec}:make_model") == (f"{spec}:make_model", (), {})
    m = load_factory(f"{spec}:make_model(num_classes=3, width=4)", "--model")
    assert (m.fc.out_features, m.conv.out_channels) == (3, 4)
    assert load_factory(f"{spec}:make_model(5)").fc.out_features == 5
    with pytest.raises(UsageError, match="not valid call syntax"):
        load_factory(f"{spec}:make_model(num_classes=3", "--model")
    with pytest.raises(UsageError, match="not a literal.*never run"):
        load_factory(f"{spec}:make_model(num_classes=__import__('os').getpid())", "--model")
    with pytest.raises(UsageError, match=r"make_model\(colour='red'\) failed.*unexpected keyword"):
        load_factory(f"{spec}:make_model(colour='red')", "--model")
    with pytest.raises(UsageError, match=r"\*\*kwargs is not supported"):
        load_factory(f"{spec}:make_model(**{{'width': 2}})", "--model")


def test_quantize_and_build_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive.cli.main import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.py").write_text(NET_PY)
    _folder(tmp_path / "imgs")
    runner = CliRunner()
    res = runner.invoke(cli, ["quantize", "--model", "net.py:make_model(num_classes=4, width=16)", "--calib-data",
                              "imgs", "--input-shape", "1,3,16,16", "--batch-size", "4", "--calib-batches", "2",
                              "--save", "q.pt", "--json", "q.json", "--no-progress"])
    assert res.exit_code == 0, res.output
    from overdrive.recipes.quantize import load_quantized

    assert load_quantized("q.pt").fc.out_features == 4  # the spec saved with its arguments rebuilds the model
    res = runner.invoke(cli, ["build", "--model", "net.py:make_model(num_classes=4)", "--int8", "--calib", "imgs",
                              "--calib-samples", "4", "--calib-normalize", "0.5:0.5", "--shapes", "x:1x3x16x16",
                              "--backend", "onnxruntime", "--save-engine", "e.engine", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert Path("e.engine").is_file()
    res = runner.invoke(cli, ["quantize", "--model", "net.py:make_model", "--calib-data", "imgs", "--input-shape",
                              "1,3,16,16", "--calib-normalize", "bogus"])
    assert isinstance(res.exception, UsageError) and "--calib-normalize 'bogus'" in str(res.exception)
