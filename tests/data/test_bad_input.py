"""Bad input to the image loader gets one UsageError naming the value and the fix: compressed tar shards (read
as a file list, or as a corrupt tar, before), non-bool flags (train='no' trained), a misspelt device (torch's
RuntimeError listing every device type), a non-int epoch (1.5 picked epoch 1's order)."""

from __future__ import annotations

import bz2
import gzip
import io
import tarfile
from pathlib import Path

import pytest

from overdrive._utils.errors import UsageError
from overdrive.data import ImageLoader, LoaderConfig


def _tar_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in (("000.jpg", b"\xff\xd8\xff\xd9"), ("000.cls", b"1")):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("name,compress,kind", [("s.tar.gz", gzip.compress, "gzip"), ("s.tgz", gzip.compress, "gzip"),
                                                 ("s.tar", gzip.compress, "gzip"), ("s.tar.bz2", bz2.compress, "bzip2")])
@pytest.mark.parametrize("as_folder", [False, True])
def test_compressed_shards_are_named(tmp_path: Path, name: str, compress, kind: str, as_folder: bool) -> None:
    (tmp_path / name).write_bytes(compress(_tar_bytes()))
    with pytest.raises(UsageError, match=rf"{kind}-compressed tar; shards must be uncompressed \.tar"):
        ImageLoader(tmp_path if as_folder else tmp_path / name, batch_size=2, pipeline="cpu")


def test_an_uncompressed_shard_still_loads(tmp_path: Path) -> None:
    (tmp_path / "s.tar").write_bytes(_tar_bytes())
    assert len(ImageLoader(tmp_path / "s.tar", batch_size=2, pipeline="cpu").samples) == 1


@pytest.mark.parametrize("flag", ["train", "channels_last", "drop_last", "fused"])
@pytest.mark.parametrize("value", ["no", "False", 0, None])
def test_flags_must_be_bools(flag: str, value: object) -> None:
    with pytest.raises(UsageError, match=rf"^{flag}=.* must be True or False$"):
        LoaderConfig(**{flag: value})


def test_numpy_bools_are_bools() -> None:
    np = pytest.importorskip("numpy")
    cfg = LoaderConfig(train=np.bool_(False))
    assert cfg.train is False and LoaderConfig.from_json(cfg.to_json()) == cfg


def test_a_misspelt_device_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "s.tar").write_bytes(_tar_bytes())
    with pytest.raises(UsageError, match=r"^device='cpux' is not a device; use 'cpu', 'cuda' or 'cuda:N'$"):
        ImageLoader(tmp_path / "s.tar", batch_size=2, device="cpux", pipeline="cpu")


@pytest.mark.parametrize("epoch", [1.5, "1", True])
def test_set_epoch_takes_ints(tmp_path: Path, epoch: object) -> None:
    (tmp_path / "s.tar").write_bytes(_tar_bytes())
    loader = ImageLoader(tmp_path / "s.tar", batch_size=2, pipeline="cpu")
    with pytest.raises(UsageError, match=r"set_epoch\(.*\): expected the epoch number as an int"):
        loader.set_epoch(epoch)
    loader.set_epoch(3)
    assert loader.epoch == 3


def test_undecodable_image_message_names_no_buffer_address() -> None:
    """Pillow's "cannot identify image file <_io.BytesIO object at 0x...>" reached the skip warnings, which name
    the file already."""
    from overdrive.data.decode import DecodeError, decode_cpu

    with pytest.raises(DecodeError) as info:
        decode_cpu(b"not an image")
    assert "BytesIO" not in str(info.value) and "0x" not in str(info.value)
    assert "cannot identify image file" in str(info.value)


def test_shuffle_must_be_a_bool_and_mean_std_finite(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``shuffle="no"`` shuffled (a non-empty string is true); a NaN std or mean made every batch NaN."""
    pytest.importorskip("PIL")
    import math

    from PIL import Image

    from overdrive.data import ImageLoader

    (tmp_path / "a").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "x.png")
    with pytest.raises(UsageError, match=r"shuffle='no' must be True, False or None"):
        ImageLoader(str(tmp_path), batch_size=1, size=8, num_workers=0, pipeline="cpu", shuffle="no")
    for kw in ({"std": (math.nan, 1, 1)}, {"mean": (math.nan, 0, 0)}, {"ratio": (0.5, math.inf)}):
        with pytest.raises(UsageError, match=r"holds a NaN or infinite value"):
            ImageLoader(str(tmp_path), batch_size=1, size=8, num_workers=0, pipeline="cpu", **kw)
