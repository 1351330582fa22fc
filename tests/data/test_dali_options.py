"""DALI's argument names passed to ImageLoader (a ported pipeline's ``random_shuffle=True``, ``crop=224``) are refused
with the option that does the same here, not with the bare list of every field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from overdrive._utils.errors import UsageError
from overdrive.data import ImageLoader, LoaderConfig
from overdrive.data.config import DALI_OPTIONS

Image = pytest.importorskip("PIL.Image")


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    (tmp_path / "a").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a" / "x.jpg")
    return tmp_path


@pytest.mark.parametrize("name,value,points_to", [
    ("random_shuffle", True, "shuffle=True"), ("num_threads", 4, "num_workers="), ("crop", 224, "size="),
    ("output_layout", "NHWC", "channels_last=True"), ("device_id", 0, "device='cuda:N'"),
    ("prefetch_queue_depth", 2, "prefetch="), ("pad_last_batch", True, "drop_last=False"),
    ("file_root", "train/", "first argument"), ("random_area", (0.08, 1.0), "scale="),
    ("random_aspect_ratio", (0.75, 1.33), "ratio="), ("mirror", 1, "flip="),
])
def test_dali_option_names_its_counterpart(folder: Path, name: str, value: object, points_to: str) -> None:
    with pytest.raises(UsageError, match=rf"{name}= \(DALI's\) is [^;]*{points_to}"):
        ImageLoader(folder, batch_size=2, pipeline="cpu", **{name: value})


def test_every_counterpart_named_exists() -> None:
    fields = set(LoaderConfig.__dataclass_fields__) | {"shuffle", "device"}
    for name, hint in DALI_OPTIONS.items():
        assert name not in fields, name  # a real option must not be refused as DALI's
        named = {w.split("=")[0].lstrip("(") for w in hint.split() if "=" in w and not w.startswith(name)}
        assert named <= fields | {"size / resize_shorter"}, (name, named - fields)


def test_other_unknown_options_still_list_the_fields(folder: Path) -> None:
    with pytest.raises(UsageError, match=r"unknown option\(s\) \['batchsize'\]; options are LoaderConfig's fields"):
        ImageLoader(folder, batch_size=2, pipeline="cpu", batchsize=4)
