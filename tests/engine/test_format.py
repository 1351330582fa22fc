"""The engine file refuses misuse: truncated, corrupted, wrong magic, future version, wrong device,
wrong precision, another torch for Inductor engines."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive.engine import format as fmt

DYN = [ShapeProfile("x", (1, 1, 8, 8), (4, 1, 8, 8), (32, 1, 8, 8))]


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory: pytest.TempPathFactory, digits_onnx: bytes) -> Path:
    path = tmp_path_factory.mktemp("fmt") / "d.engine"
    Builder(backend="onnxruntime", device="cpu", profiles=DYN).build(digits_onnx).save(path)
    return path


def _rewrite_header(src: Path, dst: Path, **changes: object) -> Path:
    ef = fmt.read(src)
    ef.header.update(changes)
    ef.save(dst)
    return dst


def test_round_trip_header(engine_path: Path) -> None:
    ef = fmt.read(engine_path)
    assert ef.header["backend"] == "onnxruntime" and ef.header["precision"] == "fp32"
    assert ef.header["device"]["type"] == "cpu" and ef.header["device"]["isa"]
    assert ef.header["inputs"][0]["min"] == [1, 1, 8, 8] and ef.header["inputs"][0]["max"] == [32, 1, 8, 8]
    assert set(ef.sections) == {"onnx"}


def test_truncated(engine_path: Path, tmp_path: Path) -> None:
    data = engine_path.read_bytes()
    for cut in (5, 30, len(data) - 10):
        bad = tmp_path / f"cut{cut}.engine"
        bad.write_bytes(data[:cut])
        with pytest.raises(UsageError, match="truncated|too short"):
            Engine.load(bad)


def test_corrupted_payload_and_header(engine_path: Path, tmp_path: Path) -> None:
    data = bytearray(engine_path.read_bytes())
    data[-100] ^= 0xFF
    (tmp_path / "c.engine").write_bytes(bytes(data))
    with pytest.raises(UsageError, match="checksum mismatch in section 'onnx'"):
        Engine.load(tmp_path / "c.engine")
    data = bytearray(engine_path.read_bytes())
    i = data.index(b'"precision": "fp32"')
    data[i + 14:i + 18] = b"fp16"  # a plausible edit that still parses as JSON
    (tmp_path / "h.engine").write_bytes(bytes(data))
    with pytest.raises(UsageError, match="header checksum mismatch"):
        Engine.load(tmp_path / "h.engine")


def test_wrong_magic_and_future_version(engine_path: Path, tmp_path: Path) -> None:
    data = engine_path.read_bytes()
    (tmp_path / "m.engine").write_bytes(b"TRTPLAN!" + data[8:])
    with pytest.raises(UsageError, match="wrong magic"):
        Engine.load(tmp_path / "m.engine")
    (tmp_path / "v.engine").write_bytes(data[:8] + struct.pack("<I", fmt.FORMAT_VERSION + 1) + data[12:])
    with pytest.raises(UsageError, match="newer than this overdrive reads"):
        Engine.load(tmp_path / "v.engine")
    with pytest.raises(UsageError, match="does not exist"):
        Engine.load(tmp_path / "missing.engine")


def test_wrong_device(engine_path: Path, tmp_path: Path) -> None:
    gpu = {"type": "cuda", "name": "NVIDIA H200", "compute_capability": "9.0"}
    bad = _rewrite_header(engine_path, tmp_path / "g.engine", device=gpu)
    if torch.cuda.is_available():
        with pytest.raises(UsageError, match="built for NVIDIA H200"):
            Engine.load(bad, device="cpu")
    else:
        with pytest.raises(UsageError, match=r"built for NVIDIA H200 \(sm 9.0\) and there is no CUDA GPU here"):
            Engine.load(bad)


def test_wrong_precision(engine_path: Path) -> None:
    with pytest.raises(UsageError, match="built for precision fp32, not int8.*rebuild with --precision int8"):
        Engine.load(engine_path, precision="int8")
    assert Engine.load(engine_path, precision="fp32").info["precision"] == "fp32"


def test_inductor_engine_from_another_torch(engine_path: Path, tmp_path: Path) -> None:
    ef = fmt.read(engine_path)
    ef.header.update(backend="inductor", torch="2.0.0")
    fmt.EngineFile(ef.header, {"exported_program": ef.sections["onnx"]}).save(tmp_path / "t.engine")
    bad = tmp_path / "t.engine"
    with pytest.raises(UsageError, match="built with torch 2.0.0"):
        Engine.load(bad)


def test_version_zero_and_large_foreign_files_are_refused_early(tmp_path, monkeypatch) -> None:
    """Version 0 was accepted; a large non-engine file was read whole before its 8-byte magic was checked."""
    import builtins
    import struct

    from overdrive._utils.errors import UsageError
    from overdrive.engine import format as fmt

    zero = tmp_path / "v0.engine"
    zero.write_bytes(struct.pack("<8sIQ", fmt.MAGIC, 0, 2) + b"{}")
    with pytest.raises(UsageError, match="version 0 does not exist"):
        fmt.read(zero)
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.write(b"NOTANENGINE")
        f.truncate(64 * 2**20)  # 64 MiB, sparse
    reads: list[int] = []
    real_open = builtins.open

    class Counting:
        def __init__(self, fh):  # noqa: ANN001
            self.fh = fh

        def read(self, n: int = -1) -> bytes:
            data = self.fh.read(n)
            reads.append(len(data))
            return data

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *a):  # noqa: ANN002
            self.fh.close()

    def counting_open(path, mode="r", *a, **k):  # noqa: ANN001, ANN002, ANN003
        fh = real_open(path, mode, *a, **k)
        return Counting(fh) if str(path) == str(big) and "b" in mode else fh

    monkeypatch.setattr(builtins, "open", counting_open)
    with pytest.raises(UsageError, match="wrong magic"):
        fmt.read(big)
    monkeypatch.undo()
    assert sum(reads) <= 64, reads


def test_build_refuses_a_missing_output_folder_before_building(tmp_path) -> None:
    import contextlib
    import io

    from overdrive.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["build", "--model", "overdrive.recipes.models:DigitsCNN", "--shapes", "x:1x1x8x8",
                     "--save-engine", str(tmp_path / "missing" / "m.engine")])
    assert code == 2 and "does not exist" in err.getvalue()


def test_channels_last_weights_save_without_warnings_and_load_equal(tmp_path: Path) -> None:
    """A CUDA engine's convolution weights are channels_last; torch's packager warned "No complete tensor found" for
    each build. save_exported stores them silently, and they load equal (the reference: the module's weights)."""
    import warnings

    from overdrive.engine.sources import load_exported, save_exported

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    ep = torch.export.export(conv, (torch.randn(1, 3, 8, 8),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = save_exported(ep)
    back = load_exported(data)
    assert torch.equal(back.state_dict["weight"], conv.weight.detach())
    x = torch.randn(1, 3, 8, 8)
    assert torch.equal(back.module()(x), conv(x))
