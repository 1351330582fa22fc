"""A shard cut short is an error naming it. Reference: a whole shard lists all 20 samples; before, a shard cut
at 50% listed 11 of 20 silently, one cut at 77% gave a raw tarfile.ReadError naming no file, and one cut at
13% a misleading "has no label member"."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from overdrive._utils.errors import UsageError
from overdrive.data.sources import from_tars


def _shard(path: Path, n: int = 20) -> Path:
    with tarfile.open(path, "w") as tf:
        for i in range(n):
            for ext, data in (("jpg", bytes([i]) * 3000), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"{i:03d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def test_whole_shards_list_every_sample(tmp_path: Path) -> None:
    path = _shard(tmp_path / "a.tar")
    assert len(from_tars([path])) == 20
    data = path.read_bytes()  # the record padding after the end-of-archive marker is not data: cutting it is fine
    (tmp_path / "short_pad.tar").write_bytes(data[:len(data) - 2048])
    assert len(from_tars([tmp_path / "short_pad.tar"])) == 20
    if shutil.which("tar"):  # GNU/BSD tar's own writer
        src = tmp_path / "src"
        src.mkdir()
        for i in range(5):
            (src / f"{i}.jpg").write_bytes(b"x" * 700)
            (src / f"{i}.cls").write_text("1")
        subprocess.run(["tar", "cf", str(tmp_path / "g.tar"), "-C", str(src), "."], check=True)
        assert len(from_tars([tmp_path / "g.tar"])) == 5


@pytest.mark.parametrize("where", [0.13, 0.5, 0.77, "member boundary"])
def test_truncated_shard_is_named(tmp_path: Path, where: float | str) -> None:
    path = _shard(tmp_path / "a.tar")
    data = path.read_bytes()
    if where == "member boundary":  # the quietest cut: whole members, then nothing (no end-of-archive marker)
        with tarfile.open(path) as tf:
            at = [m.offset for m in tf.getmembers()][22]
    else:
        at = int(len(data) * float(where))
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:at])
    with pytest.raises(UsageError, match=r"cut\.tar.*(truncated|corrupt)"):
        from_tars([cut])
