"""Inductor backend on CPU: build -> save -> load -> run against PyTorch (an AOTInductor package where it loads,
else the program + compile cache), dynamic profiles, freezing, I/O formats, TorchScript input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive.recipes.build import build_engine

DYN = [ShapeProfile("x", (1, 16), (4, 16), (32, 16))]


@pytest.fixture(scope="module")
def mlp() -> torch.nn.Module:
    # small on purpose: Inductor's C++ compile on a shared 2-core box is the slow part of this file
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, mlp: torch.nn.Module) -> tuple[Engine, Path]:
    eng = Builder(backend="inductor", device="cpu", profiles=DYN).build(mlp)
    path = tmp_path_factory.mktemp("ind") / "d.engine"
    eng.save(path)
    return eng, path


def test_round_trip_dynamic(built: tuple[Engine, Path], mlp: torch.nn.Module) -> None:
    from overdrive.engine.backends.inductor import aoti_works

    eng, path = built
    # CPU builds store an AOTInductor package where it loads (torch >= 2.12), else the program + compile cache
    stored = {"exported_program", "aoti_package"} if aoti_works() else {"exported_program", "compile_cache"}
    assert eng.info["backend"] == "inductor" and set(eng.sections) >= stored
    loaded = Engine.load(path)
    assert loaded.info["runtime"].startswith("AOTInductor" if aoti_works() else "torch.compile")
    assert loaded.load_s < eng.build_s
    for batch in (1, 4, 32):
        x = torch.randn(batch, 16)
        with torch.no_grad():
            ref = mlp(x)
        torch.testing.assert_close(eng(x), ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(loaded(x), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(UsageError, match="outside the engine's profile"):
        loaded(torch.randn(64, 16))


def test_benchmark_summary(built: tuple[Engine, Path]) -> None:
    s = built[0].benchmark(inputs=(torch.randn(1, 16),), iterations=50, duration_s=0.2, warmup_ms=10)
    assert s["backend"] == "inductor" and s["iterations"] >= 50
    assert 0.6 < s["latency_ms"]["mean"] / 1e3 * s["throughput_qps"] <= 1.0


def test_freezing_folds_bn_and_survives_reload(tmp_path: Path) -> None:
    """--freezing (on by default for CUDA): conv+BN with non-trivial BN statistics, frozen, equals eager
    PyTorch to fp32 rounding, and the reloaded engine compiles with freezing too (the header says so)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2.0)
        m[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8, 8)
    eng = Builder(backend="inductor", device="cpu", freezing=True,
                  profiles=[ShapeProfile.fixed("x", (2, 3, 8, 8))]).build(m, (x,), input_names=["x"])
    assert eng.header["backend_meta"]["freezing"] is True
    with torch.no_grad():
        ref = m(x)
    torch.testing.assert_close(eng(x), ref, atol=1e-5, rtol=1e-5)
    eng.save(tmp_path / "f.engine")
    loaded = Engine.load(tmp_path / "f.engine")
    assert loaded.header["backend_meta"]["freezing"] is True
    torch.testing.assert_close(loaded(x), ref, atol=1e-5, rtol=1e-5)


def test_load_reports_the_inductor_graph_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A torch.compile-path engine compiles at load; the load says whether Inductor's graph cache served it
    (on CPU, frozen graphs hold mkldnn weights and bypass the cache: a frozen CPU load recompiles)."""
    from overdrive.cli.main import main

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    Builder(backend="inductor", device="cpu", aot=False, profiles=[ShapeProfile.fixed("x", (2, 8))]).build(
        m, input_names=["x"]).save(tmp_path / "c.engine")
    torch.compiler.reset()
    loaded = Engine.load(tmp_path / "c.engine")
    lc = loaded.info["load_compile"]
    assert set(lc) == {"hit", "miss", "bypass"} and lc["hit"] + lc["miss"] >= 1 and lc["bypass"] == 0
    torch.compiler.reset()
    assert main(["exec", "--load-engine", str(tmp_path / "c.engine"), "--duration", "0.05", "--iterations", "5"]) == 0
    assert "Inductor graph cache:" in capsys.readouterr().out


def test_freezing_default_is_cuda_only() -> None:
    from overdrive.engine.backends.inductor import use_freezing
    from overdrive.engine.config import BuildConfig

    assert use_freezing(BuildConfig(), torch.device("cuda")) is True
    assert use_freezing(BuildConfig(), torch.device("cpu")) is False
    assert use_freezing(BuildConfig(freezing=False), torch.device("cuda")) is False


def test_torchscript_goes_through_onnx(tmp_path: Path, digits: torch.nn.Module) -> None:
    ts = tmp_path / "d.pt"
    torch.jit.trace(digits, torch.randn(2, 1, 8, 8)).save(str(ts))
    eng = build_engine(torchscript=str(ts), save_engine=str(tmp_path / "ts.engine"), shapes="input:2x1x8x8",
                       device="cpu", backend="onnxruntime")
    assert eng.info["source"] == "torchscript"
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(Engine.load(tmp_path / "ts.engine")(x), digits(x), atol=1e-5, rtol=1e-4)
    with pytest.raises(UsageError, match="--torchscript needs --shapes"):
        build_engine(torchscript=str(ts), save_engine=str(tmp_path / "x.engine"), device="cpu")


def test_cast_float_remainder_keeps_int8_gemms() -> None:
    """int8/fp8 CUDA builds run the layers without a low-precision kernel in fp16 (trtexec --int8 --fp16);
    the real int8 GEMMs keep their int8 weights and fp32 scales, and the model still computes the same."""
    quant = pytest.importorskip("overdrive.quant")
    from overdrive.engine.backends.prepare import cast_float_remainder, remainder_dtype
    from overdrive.quant.real import Int8Linear

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 16)).eval()
    x = torch.randn(32, 32)
    ref = m(x).detach()
    q = quant.quantize(m, quant.INT8_DEFAULT, lambda mm: mm(x))
    real = quant.to_real(q)
    with torch.no_grad():
        before = real(x).clone()
    cast_float_remainder(real, torch.bfloat16)
    lins = [mod for mod in real.modules() if isinstance(mod, Int8Linear)]
    assert lins and all(lin.w_q.dtype == torch.int8 and lin.x_scale.dtype == torch.float32 for lin in lins)
    assert real[1].weight.dtype == torch.bfloat16  # the LayerNorm: no int8 kernel, so half precision
    with torch.no_grad():
        after = real(x.bfloat16()).float()
    assert after.dtype == torch.float32 and (after - before).abs().max() < 0.05 * before.abs().max()
    assert (before - ref).abs().max() < 0.1 * ref.abs().max()
    assert remainder_dtype("int8", torch.device("cuda")) == torch.float16
    assert remainder_dtype("int8", torch.device("cpu")) is None and remainder_dtype("fp16", torch.device("cuda")) is None


def test_io_formats_fp16_channels_last(tmp_path: Path) -> None:
    """trtexec's --inputIOFormats/--outputIOFormats: the engine's bindings take fp16 channels_last input and
    give fp16 output (no fp32 conversion passes), recorded in the header and kept after a reload."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 4)).eval()
    x = torch.randn(2, 3, 6, 6)
    eng = Builder(backend="auto", device="cpu", profiles=[ShapeProfile.fixed("x", (2, 3, 6, 6))],
                  input_io_formats=["fp16:hwc"], output_io_formats=["fp16:chw"]).build(m, (x,), input_names=["x"])
    assert eng.info["backend"] == "inductor"  # auto picks the backend that honours I/O formats
    assert eng.header["inputs"][0]["dtype"] == "float16" and eng.header["inputs"][0]["layout"] == "hwc"
    assert eng.header["outputs"][0]["dtype"] == "float16"
    with torch.no_grad():
        ref = m(x.half().float())  # the input binding rounds to fp16; compute stays fp32
    out = eng(x.half().contiguous(memory_format=torch.channels_last))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    eng.save(tmp_path / "io.engine")
    loaded = Engine.load(tmp_path / "io.engine")
    r = loaded.random_inputs()[0]
    assert r.dtype == torch.float16 and r.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(loaded(x).float(), ref, atol=2e-3, rtol=2e-3)  # fp32 given: cast at the binding


def test_io_formats_bad_values() -> None:
    from overdrive.engine.config import parse_io_formats

    with pytest.raises(UsageError, match="'fp17:chw' .*is not type:layout"):
        parse_io_formats("fp17:chw")
    with pytest.raises(UsageError, match="layout one of chw, hwc, hwc8"):
        parse_io_formats("fp16:nhwc")
    m = torch.nn.Linear(4, 2).eval()
    with pytest.raises(UsageError, match="need the inductor backend"):
        Builder(backend="onnxruntime", device="cpu", input_io_formats=["fp16:chw"]).build(m, (torch.randn(2, 4),))
    with pytest.raises(UsageError, match="gives 2 formats for 1 inputs"):
        Builder(backend="inductor", device="cpu", input_io_formats=["fp16:chw", "fp32:chw"]).build(m, (torch.randn(2, 4),))
    # one float format for a model whose only input is integer: the flag changed nothing, without a word, before
    emb = torch.nn.Embedding(10, 4).eval()
    with pytest.raises(UsageError, match=r"--inputIOFormats fp16:chw applies to no input \(.* torch.int64\): give an "
                                         r"integer type, e.g. int64:chw"):
        Builder(backend="inductor", device="cpu", input_io_formats=["fp16:chw"]).build(emb, (torch.zeros(2, 3, dtype=torch.long),))


def test_cli_io_formats(tmp_path: Path, digits_onnx: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    """`overdrive build --inputIOFormats fp16:hwc --outputIOFormats fp16:chw` then `exec` (inputs made in the
    binding's type) and a one-line error for a bad format."""
    from overdrive.cli.main import main

    onnx_path = tmp_path / "d.onnx"
    onnx_path.write_bytes(digits_onnx)
    eng = tmp_path / "d.engine"
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(eng), "--shapes", "x:2x1x8x8", "--device", "cpu",
                 "--inputIOFormats", "fp16:hwc", "--outputIOFormats", "fp16:chw", "--json", "-"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backend"] == "inductor" and info["inputs"][0]["dtype"] == "float16"
    assert main(["exec", "--load-engine", str(eng), "--iterations", "5", "--duration", "0.05"]) == 0
    capsys.readouterr()
    # compare hands the engine's fp16 inputs to ONNX Runtime, which wants the model's fp32 (it failed before)
    assert main(["compare", str(eng), str(onnx_path), "--atol", "1e-2", "--rtol", "1e-2"]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(eng), "--shapes", "x:2x1x8x8", "--device", "cpu",
                 "--inputIOFormats", "half"]) == 2
    err = capsys.readouterr().err
    assert "--inputIOFormats half: I/O format 'half' is not type:layout" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_frozen_call_sees_the_build_setting_and_puts_the_callers_back() -> None:
    """Each call of a frozen engine's program runs under ``freezing=True`` (a recompile for a new shape reads it),
    and the caller's setting is back after it, also when the call raises."""
    import torch._inductor.config as inductor_config

    from overdrive.engine.backends.inductor import _Frozen

    seen: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append(inductor_config.freezing)
        if x.numel() == 0:
            raise ValueError("empty")
        return x

    frozen = _Frozen(fn, True)
    caller = inductor_config.freezing
    frozen(torch.ones(1))
    with pytest.raises(ValueError):
        frozen(torch.ones(0))
    assert seen == [True, True] and inductor_config.freezing == caller
    with inductor_config.patch(freezing=True):  # already as the engine needs: left alone
        frozen(torch.ones(1))
        assert inductor_config.freezing is True
    assert seen == [True, True, True] and inductor_config.freezing == caller
