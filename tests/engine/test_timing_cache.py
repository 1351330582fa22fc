"""``--timing-cache FILE`` (trtexec's ``--timingCacheFile``): Inductor's compile cache carried across
builds. Building twice with one file works and the second build loads it; a corrupt file is a clear
UsageError naming the file; the onnxruntime backend warns that the flag has no effect."""

from __future__ import annotations

import re

from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine import Builder, BuildConfig, Engine, ShapeProfile

STATIC = [ShapeProfile.fixed("x", (4, 16))]


@pytest.fixture(scope="module")
def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


def test_build_twice_with_one_cache_file(tmp_path: Path, mlp: torch.nn.Module) -> None:
    cache = tmp_path / "mlp.cache"
    cfg = BuildConfig(backend="inductor", device="cpu", profiles=STATIC, timing_cache=str(cache))
    assert BuildConfig.from_json(cfg.to_json()) == cfg
    first = Builder(cfg).build(mlp)
    tc = first.info["timing_cache"]
    assert tc["path"] == str(cache) and tc["loaded"] is False  # no file yet: built from scratch
    assert cache.is_file() and cache.stat().st_size > 0 and tc["saved_bytes"] == cache.stat().st_size
    written = cache.read_bytes()
    second = Builder(cfg).build(mlp)
    tc2 = second.info["timing_cache"]
    assert tc2["loaded"] is True and tc2["loaded_bytes"] == len(written) and tc2["loaded_artifacts"] >= 1
    assert cache.stat().st_size > 0
    assert not list(tmp_path.glob(".timing-cache-*"))  # the atomic write left no temp file
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = mlp(x)
    torch.testing.assert_close(second(x), ref, atol=1e-5, rtol=1e-5)
    # saved with the engine and back: the header keeps what happened
    second.save(tmp_path / "m.engine")
    assert Engine.load(tmp_path / "m.engine").info["timing_cache"]["loaded"] is True


def test_corrupt_cache_file_is_a_usage_error(tmp_path: Path, mlp: torch.nn.Module) -> None:
    bad = tmp_path / "bad.cache"
    bad.write_bytes(b"this is not an inductor cache" * 10)
    with pytest.raises(UsageError, match=r"--timing-cache .*bad\.cache.*not signed"):  # refused unread
        Builder(backend="inductor", device="cpu", profiles=STATIC, timing_cache=str(bad)).build(mlp)
    with pytest.raises(UsageError, match=r"--timing-cache .*bad\.cache.*not an Inductor compile cache"):
        Builder(backend="inductor", device="cpu", profiles=STATIC, timing_cache=str(bad), trust_timing_cache=True).build(mlp)
    assert bad.read_bytes() == b"this is not an inductor cache" * 10  # left as it was
    with pytest.raises(UsageError, match=r"nofolder.*does not exist"):
        Builder(backend="inductor", device="cpu", profiles=STATIC,
                timing_cache=str(tmp_path / "nofolder" / "c.cache")).build(mlp)


def test_onnxruntime_warns_and_cli_spellings(tmp_path: Path, digits_onnx: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    onnx_path = tmp_path / "d.onnx"
    onnx_path.write_bytes(digits_onnx)
    cache = tmp_path / "ort.cache"
    for flag in ("--timing-cache", "--timingCacheFile"):
        assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "d.engine"),
                     "--shapes", "x:2x1x8x8", "--device", "cpu", "--backend", "onnxruntime", flag, str(cache)]) == 0
        out = capsys.readouterr()  # the CLI prints warnings as one "warning: ..." line
        assert "backend onnxruntime" in out.out
        assert re.search(r"warning: .*ort\.cache has no effect with the onnxruntime backend", out.err)
    assert not cache.exists()  # neither read nor written
    bad = tmp_path / "bad.cache"
    bad.write_bytes(b"garbage")
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "i.engine"), "--shapes", "x:2x1x8x8",
                 "--device", "cpu", "--backend", "inductor", "--timingCacheFile", str(bad)]) == 2
    assert "bad.cache" in capsys.readouterr().err
    good = tmp_path / "good.cache"
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(tmp_path / "i.engine"), "--shapes", "x:2x1x8x8",
                 "--device", "cpu", "--backend", "inductor", "--timing-cache", str(good)]) == 0
    out = capsys.readouterr().out
    assert "timing cache" in out and good.stat().st_size > 0
    assert re.search(r"\[I\] build phases: export [0-9.]+ s, passes [0-9.]+ s, compile [0-9.]+ s", out)


def test_a_rebuild_reuses_the_int8_layer_timings(tmp_path: Path, mlp: torch.nn.Module) -> None:
    """The cache also keeps the int8 layer timing's verdicts (TensorRT's timing cache keeps tactic timings): the
    second build takes both layers' verdicts from the file and times none, with the same layers kept float."""
    import warnings

    cache = tmp_path / "int8.cache"
    cfg = BuildConfig(backend="inductor", device="cpu", precision="int8", int8_activations="dynamic",
                      profiles=STATIC, timing_cache=str(cache))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = Builder(cfg).build(mlp)
        second = Builder(cfg).build(mlp)
    assert first.info["timing_cache"]["saved_layer_timings"] == 2
    assert first.info["timing_cache"]["reused_layer_timings"] == 0
    tc = second.info["timing_cache"]
    assert tc["loaded_layer_timings"] == 2 and tc["reused_layer_timings"] == 2
    assert "layer_timing.gemm" in first.info["build_phases_s"]
    assert "layer_timing.gemm" not in second.info["build_phases_s"]  # nothing timed
    assert second.header.get("layers_kept_float") == first.header.get("layers_kept_float")
    assert second.info["layers"] == first.info["layers"]


def test_an_old_cache_without_layer_timings_still_loads(tmp_path: Path, mlp: torch.nn.Module) -> None:
    # a file written before the layer timings were kept (payload: Inductor's artifacts only) loads as before;
    # a payload whose timings are not JSON is a clear error naming the file
    from overdrive._utils.signing import sign, signing_key
    from overdrive.engine.backends.timing_cache import CACHE_MAGIC, LAYERS_MAGIC, load_timing_cache

    cache = tmp_path / "m.cache"
    Builder(BuildConfig(backend="inductor", device="cpu", profiles=STATIC, timing_cache=str(cache))).build(mlp)
    raw = cache.read_bytes()
    artifacts = raw[len(CACHE_MAGIC) + 64:]
    key = signing_key(create=True).key
    cache.write_bytes(CACHE_MAGIC + sign(artifacts, key).encode("ascii") + artifacts)
    info = load_timing_cache(str(cache))
    assert info["loaded"] is True and info["loaded_layer_timings"] == 0 and info["layer_timings"] == {}
    bad = LAYERS_MAGIC + (3).to_bytes(8, "little") + b"{x}" + artifacts
    cache.write_bytes(CACHE_MAGIC + sign(bad, key).encode("ascii") + bad)
    with pytest.raises(UsageError, match=r"m\.cache: its layer timings are not the JSON object"):
        load_timing_cache(str(cache))
