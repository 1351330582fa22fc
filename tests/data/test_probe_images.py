"""Real-world image folders: Netpbm files (torchvision's ImageFolder reads .ppm/.pgm) and EXIF-rotated photos."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive.data import ImageLoader, LoaderConfig
from overdrive.data.decode import decode_cpu, exif_orientation, gpu_decodable
from overdrive.data.loader import _BytesDataset
from overdrive.data.sources import from_folder, from_tars

from .conftest import smooth_image

Image = pytest.importorskip("PIL.Image")
ImageOps = pytest.importorskip("PIL.ImageOps")


def _collect(loader: ImageLoader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*[(x, y) for x, y in loader])
    return torch.cat(xs), torch.cat(ys)


def test_netpbm_files_are_images_as_in_torchvision_imagefolder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "stop").mkdir()
    (tmp_path / "yield").mkdir()
    Image.fromarray(smooth_image(rng, 20, 30)).save(tmp_path / "stop" / "00000_00000.ppm")  # GTSRB's layout
    Image.fromarray(smooth_image(rng, 20, 30)[..., 0]).save(tmp_path / "yield" / "a.PGM")
    Image.fromarray(smooth_image(rng, 20, 30)).save(tmp_path / "yield" / "b.jpg")
    samples, classes = from_folder(tmp_path)
    assert classes == ["stop", "yield"]
    assert sorted((Path(s.path).name, s.label) for s in samples) == [("00000_00000.ppm", 0), ("a.PGM", 1), ("b.jpg", 1)]
    x, y = _collect(ImageLoader(tmp_path, batch_size=4, size=16, train=False, num_workers=0, pipeline="cpu",
                                shuffle=False))
    assert x.shape == (3, 3, 16, 16) and y.tolist() == [0, 1, 1]


def test_ppm_in_a_tar_shard_is_the_sample_image(tmp_path: Path) -> None:
    import tarfile

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, format="PPM")
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tf:
        for name, data in (("000.ppm", buf.getvalue()), ("000.cls", b"4")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    (sample,) = from_tars([shard])
    assert sample.label == 4 and sample.read() == buf.getvalue()


def _rotated_jpeg(arr: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_decode_applies_exif_orientation_as_pillow_exif_transpose(orientation: int) -> None:
    data = _rotated_jpeg(smooth_image(np.random.default_rng(orientation), 20, 36), orientation)
    assert exif_orientation(data) == orientation
    with Image.open(io.BytesIO(data)) as im:
        stored = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        upright = torch.from_numpy(np.asarray(ImageOps.exif_transpose(im).convert("RGB")).copy()).permute(2, 0, 1)
    assert torch.equal(decode_cpu(data), stored)  # the default: pixels as stored, as torchvision's default
    assert torch.equal(decode_cpu(data, apply_exif_orientation=True), upright)
    assert upright.shape[1:] == ((36, 20) if orientation >= 5 else (20, 36))  # 5-8 swap width and height
    # the GPU path sends a rotated JPEG to the CPU decoder (nvJPEG does not turn it); upright ones stay on the GPU
    assert gpu_decodable(data) and gpu_decodable(data, True) == (orientation == 1)


@pytest.mark.parametrize("train", [True, False])
def test_loader_with_exif_orientation_equals_loader_on_upright_files(tmp_path: Path, train: bool) -> None:
    """A phone-photo folder (JPEGs stored sideways with an orientation tag) against the same photos turned upright
    beforehand with PIL and saved losslessly: the same batches, bit for bit."""
    rng = np.random.default_rng(1)
    tagged, upright = tmp_path / "tagged", tmp_path / "upright"
    for i in range(6):
        for root in (tagged, upright):
            (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        data = _rotated_jpeg(smooth_image(rng, 24, 40), (6, 8, 3, 1, 5, 2)[i])
        (tagged / f"c{i % 2}" / f"{i}.jpg").write_bytes(data)
        with Image.open(io.BytesIO(data)) as im:
            ImageOps.exif_transpose(im).convert("RGB").save(upright / f"c{i % 2}" / f"{i}.png")
    kw = dict(batch_size=4, size=20, train=train, seed=3, num_workers=0, pipeline="cpu")
    x, y = _collect(ImageLoader(tagged, apply_exif_orientation=True, **kw))
    xr, yr = _collect(ImageLoader(upright, **kw))
    assert torch.equal(y, yr) and torch.equal(x, xr)
    x_off, _ = _collect(ImageLoader(tagged, **kw))  # off by default: the sideways pixels, a different batch
    assert not torch.equal(x_off, xr)


def test_gpu_reader_flags_rotated_jpegs_for_the_cpu(tmp_path: Path) -> None:
    from overdrive.data.sources import Sample

    arr = smooth_image(np.random.default_rng(2), 16, 24)
    paths = []
    for o in (1, 6):
        p = tmp_path / f"{o}.jpg"
        p.write_bytes(_rotated_jpeg(arr, o))
        paths.append(str(p))
    samples = [Sample(p, 0) for p in paths]
    assert _BytesDataset(samples, [[0, 1]], [0])[0][3].tolist() == [True, True]
    assert _BytesDataset(samples, [[0, 1]], [0], exif=True)[0][3].tolist() == [True, False]


def test_exif_option_round_trips_and_is_checked() -> None:
    cfg = LoaderConfig(apply_exif_orientation=True)
    assert LoaderConfig.from_json(cfg.to_json()) == cfg
    assert "apply_exif_orientation" not in LoaderConfig().to_json()  # left out at its default: old JSON holds
    from overdrive._utils.errors import UsageError

    with pytest.raises(UsageError, match="apply_exif_orientation='yes' must be True or False"):
        LoaderConfig(apply_exif_orientation="yes")


def test_broken_exif_block_keeps_the_image() -> None:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 12, 3), 90, np.uint8)).save(buf, format="JPEG", exif=b"Exif\x00\x00garbage-not-tiff")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow may warn about the EXIF block itself
        assert exif_orientation(buf.getvalue()) == 1
        assert decode_cpu(buf.getvalue(), apply_exif_orientation=True).shape == (3, 8, 12)


@pytest.mark.gpu
def test_gpu_pipeline_turns_rotated_jpegs_as_the_cpu_pipeline(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("torchvision")
    rng = np.random.default_rng(4)
    for i in range(8):
        (tmp_path / f"c{i % 2}").mkdir(exist_ok=True)
        (tmp_path / f"c{i % 2}" / f"{i}.jpg").write_bytes(_rotated_jpeg(smooth_image(rng, 24, 40), 1 + i))
    kw = dict(batch_size=4, size=20, seed=1, num_workers=0, read_workers=0, apply_exif_orientation=True)
    xg, yg = _collect(ImageLoader(tmp_path, device="cuda", pipeline="gpu", **kw))
    xc, yc = _collect(ImageLoader(tmp_path, device="cuda", pipeline="cpu", **kw))
    assert torch.equal(yg, yc)
    assert float((xg.float() - xc.float()).abs().mean()) < 0.035  # nvJPEG vs libjpeg: a level or two per pixel
