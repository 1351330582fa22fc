"""The loader reads only regular files, with a size cap. Reference: such files are skipped and counted like
corrupt images, and the rest of the batch loads. Before: a FIFO named pipe.jpg hung the loader for ever, and
a zero.jpg -> /dev/zero link was read until MemoryError (6.8 GB)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
PIL = pytest.importorskip("PIL.Image")


def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "imgs" / "a"
    root.mkdir(parents=True)
    for i in range(4):
        buf = io.BytesIO()
        PIL.new("RGB", (16, 16), (i * 40, 10, 10)).save(buf, format="JPEG")
        (root / f"{i}.jpg").write_bytes(buf.getvalue())
    return root.parent


class _Hung(BaseException):  # not an OSError: the loader must not swallow it as an unreadable file
    pass


def _hung(*_: object) -> None:
    raise _Hung("the loader blocked on the FIFO")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX only")
def test_fifo_is_skipped_not_opened(tmp_path: Path) -> None:
    from overdrive.data import ImageLoader

    root = _folder(tmp_path)
    os.mkfifo(root / "a" / "pipe.jpg")
    loader = ImageLoader(root, batch_size=8, size=8, device="cpu", num_workers=0, pipeline="cpu")
    signal.signal(signal.SIGALRM, _hung)
    signal.alarm(20)  # opening a FIFO for reading blocks until a writer comes: fail instead of hanging
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            batches = list(loader)
    finally:
        signal.alarm(0)
    assert sum(len(y) for _, y in batches) == 4 and loader.stats.skipped == 1


_ZERO = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # an endless read fails fast here, not the suite
from overdrive.data import ImageLoader
warnings.simplefilter("ignore")
loader = ImageLoader(sys.argv[1], batch_size=8, size=8, device="cpu", num_workers=0, pipeline="cpu")
print(sum(len(y) for _, y in loader), loader.stats.skipped)
"""


@pytest.mark.skipif(not os.path.exists("/dev/zero") or sys.platform != "linux", reason="Linux only")
def test_link_to_a_device_is_skipped_not_read(tmp_path: Path) -> None:
    root = _folder(tmp_path)
    os.symlink("/dev/zero", root / "a" / "zero.jpg")
    proc = subprocess.run([sys.executable, "-c", _ZERO, str(root)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["4", "1"]


def test_size_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from overdrive._utils.errors import UsageError
    from overdrive.data.sources import Sample, max_file_bytes

    path = tmp_path / "big.jpg"
    path.write_bytes(b"\xff" * 5000)
    monkeypatch.setenv("OVERDRIVE_MAX_FILE_BYTES", "4096")
    with pytest.raises(OSError, match="over the 4,096-byte limit"):
        Sample(str(path), 0).read()
    monkeypatch.setenv("OVERDRIVE_MAX_FILE_BYTES", "9000")
    assert len(Sample(str(path), 0).read()) == 5000
    monkeypatch.setenv("OVERDRIVE_MAX_FILE_BYTES", "lots")
    with pytest.raises(UsageError, match="not a whole number"):
        max_file_bytes()


@pytest.mark.parametrize("mode,value,expected", [("I;16", 32768, 128), ("I;16", 65535, 255), ("I", 1000, 4),
                                                 ("F", 0.5, 128)])  # I: a 32-bit gray TIFF
def test_16_bit_and_float_gray_images_are_scaled_not_clipped(mode: str, value: float, expected: int) -> None:
    """Reference: the value scaled to 8 bits (16-bit: / 257; float: 0..1 * 255). Pillow's convert("RGB") clipped
    every 16-bit value above 255 to white: a half-gray depth map decoded as 255."""
    import io

    import numpy as np
    from PIL import Image

    from overdrive.data.decode import decode_cpu

    import torch

    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    im = Image.fromarray(np.full((4, 4), value, dtype))
    buf = io.BytesIO()
    im.save(buf, format="PNG" if mode == "I;16" else "TIFF")
    out = decode_cpu(buf.getvalue())
    assert out.shape == (3, 4, 4) and out.dtype == torch.uint8
    assert out.flatten().tolist() == [expected] * 48
