"""int8 engines with dynamic activations (issue 21): per-token activation scales computed at run time and int8
weights per output channel, no calibration (``BuildConfig(int8_activations="dynamic")``, ``--int8-activations``).

A small BERT with a dynamic batch x sequence profile; the reference is the fp32 module at each shape, the measure
the mean per-token cosine of ``last_hidden_state``. Every weight GEMM (the model's 13 Linear layers: 12 in the
encoder, the pooler) must run as an integer kernel: an ONNX Runtime one, counted in the optimized graph the engine
stores (``backend_meta["int8_ops"]``), or a ``torch._int_mm`` layer on the inductor backend; the auto mode picks
dynamic without calibration data, static with it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine import Builder, BuildConfig, Engine, ShapeProfile, backends
from overdrive.engine import int8 as int8_mode
from overdrive.engine.sources import from_module

tf = pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")

NAMES = ["input_ids", "attention_mask"]
PROFILES = tuple(ShapeProfile(n, (1, 1), (2, 16), (4, 48)) for n in NAMES)
SHAPES = [(1, 1), (3, 5), (2, 17), (4, 48)]


def _bert() -> nn.Module:
    torch.manual_seed(0)
    return tf.BertModel(tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=200)).eval()


def _inputs(b: int, s: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 31 * b + s)
    ids = torch.randint(0, 200, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[0, s // 2 + 1:] = 0  # a padded row
    return ids, mask


def _calib() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [_inputs(4, 16, seed=100 + i) for i in range(3)]


def _linears(model: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in model.modules())


def _token_cosine(ref: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool().reshape(-1)
    a, b = ref.double().reshape(-1, ref.shape[-1])[keep], out.double().reshape(-1, out.shape[-1])[keep]
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


def _check_lengths(engine: Engine, model: nn.Module) -> None:
    """Every shape of the profile runs; cosine to fp32 >= 0.99, and the outputs are not the fp32 ones (quantized)."""
    for b, s in SHAPES:
        ids, mask = _inputs(b, s)
        out = engine(ids, mask)
        out = out[0] if isinstance(out, (tuple, dict)) else out  # an EngineOutput by key: its first
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert out.shape == ref.shape
        cos = _token_cosine(ref, out, mask)
        assert cos >= 0.99, (b, s, cos)
        assert float((out - ref).abs().max()) > 1e-6, (b, s)  # int8 arithmetic, not the fp32 graph


def _build(model: nn.Module, **cfg) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # dynamic int8 needs no calibration: no "timing only" warning
        return Builder(BuildConfig(precision="int8", backend="onnxruntime", profiles=PROFILES, **cfg)).build(model)


@pytest.fixture(scope="module")
def dynamic_engine() -> tuple[nn.Module, Engine]:
    model = _bert()
    return model, _build(model, int8_activations="dynamic")


def test_dynamic_int8_bert_runs_every_length_with_integer_gemms(dynamic_engine: tuple[nn.Module, Engine],
                                                                tmp_path: Path) -> None:
    model, eng = dynamic_engine
    _check_lengths(eng, model)
    h = eng.header
    assert h["config"]["int8_activations"] == "dynamic" and h["precision"] == "int8"
    ops = h["backend_meta"]["int8_ops"]
    assert sum(ops.values()) == _linears(model) == 13, ops  # every weight MatMul/Gemm, nothing else
    assert set(ops) <= {"DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulInteger"}
    assert eng.info["int8"] == {"activations": "dynamic", "why": "asked for", "ops": ops}
    graph_ops = {n.op_type for n in onnx.load_from_string(eng.sections["onnx"]).graph.node}
    assert not graph_ops & {"QuantizeLinear", "QLinearMatMul"}  # no static scales anywhere
    acc = eng.info["accuracy"]  # measured against the float model, as for static int8
    assert acc["vs"] == "fp32" and acc["on"] == "example inputs" and acc["passed"] is True and acc["cosine"] >= 0.99
    eng.save(tmp_path / "d.engine")
    loaded = Engine.load(tmp_path / "d.engine")
    assert loaded.info["int8"] == eng.info["int8"] and loaded.header["config"]["int8_activations"] == "dynamic"
    _check_lengths(loaded, model)


def test_dynamic_int8_on_inductor_runs_int_mm_per_token() -> None:
    """The inductor backend builds it from the PyTorch model: every Linear becomes a per-token torch._int_mm layer
    (``layer_precision="all"``: the default timed choice may keep them float on a CPU without VNNI)."""
    model = _bert()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        eng = Builder(BuildConfig(precision="int8", backend="inductor", profiles=PROFILES,
                                  layer_precision="all")).build(model)  # auto
    assert eng.header["config"]["int8_activations"] == "dynamic"
    assert eng.info["int8"]["ops"] == {"torch._int_mm": _linears(model)}
    assert eng.info["accuracy"]["vs"] == "fp32" and eng.info["accuracy"]["passed"] is True
    _check_lengths(eng, model)
    fp32 = from_module(model, NAMES).as_onnx(_inputs(2, 16), list(PROFILES))
    with pytest.raises(UsageError, match=r"dynamic int8 from an ONNX model is built by the onnxruntime backend"):
        Builder(BuildConfig(precision="int8", backend="inductor", profiles=PROFILES,
                            int8_activations="dynamic")).build(fp32)
    with pytest.raises(UsageError, match=r"dynamic int8 is built for CPU engines .* on CUDA build static int8"):
        int8_mode.resolve("dynamic", backends.get("inductor"), torch.device("cuda"), from_module(model, NAMES), None)


def test_dynamic_int8_from_a_float_onnx_model() -> None:
    model = _bert()
    fp32 = from_module(model, NAMES).as_onnx(_inputs(2, 16), list(PROFILES))
    eng = _build(fp32, int8_activations="dynamic")
    _check_lengths(eng, model)
    assert "calibration" not in eng.header  # no quantize_static pass
    assert sum(eng.header["backend_meta"]["int8_ops"].values()) == 13
    assert eng.info["accuracy"]["vs"] == "fp32" and eng.info["accuracy"]["passed"] is True


def test_auto_is_dynamic_for_gemm_models_smoothed_with_calibration_and_static_for_onnx_with_it() -> None:
    model = _bert()
    eng = _build(model)
    assert eng.header["config"]["int8_activations"] == "dynamic"
    assert eng.info["int8"]["why"].startswith("auto: no calibration data") and "smoothquant" not in eng.info["int8"]
    # a PyTorch GEMM model with calibration data on inductor: dynamic scales after SmoothQuant from it
    smoothed = Builder(BuildConfig(precision="int8", backend="inductor", profiles=PROFILES,
                                   layer_precision="all")).build(model, calib=_calib())
    assert smoothed.header["config"]["int8_activations"] == "dynamic"
    assert "SmoothQuant" in smoothed.info["int8"]["why"]
    assert smoothed.info["int8"]["smoothquant"].startswith(f"alpha 0.5 on {_linears(model)} Linear")
    assert smoothed.info["accuracy"]["passed"] is True and smoothed.info["accuracy"]["cosine"] >= 0.99
    _check_lengths(smoothed, model)
    assert smoothed.info["int8"]["ops"] == {"torch._int_mm": _linears(model)}  # every smoothed layer int8
    # on onnxruntime (per-tensor dynamic MatMuls, where smoothing measured no better) calibration data means static
    ort = Builder(BuildConfig(precision="int8", backend="onnxruntime", profiles=PROFILES)).build(model, calib=_calib())
    assert ort.header["config"]["int8_activations"] == "static" and "smoothquant" not in ort.info["int8"]
    assert ort.info["int8"]["why"].endswith("(dynamic int8 after SmoothQuant is built on the inductor backend)")
    # a float ONNX model with calibration data stays static (SmoothQuant needs the PyTorch model)
    fp32 = from_module(model, NAMES).as_onnx(_inputs(2, 16), list(PROFILES))
    calibrated = Builder(BuildConfig(precision="int8", backend="onnxruntime", profiles=PROFILES)).build(
        fp32, calib=_calib())
    assert calibrated.header["config"]["int8_activations"] == "static"
    assert calibrated.info["int8"]["why"].startswith("auto: calibration data given (--calib) to an ONNX model")
    ops = calibrated.header["backend_meta"]["int8_ops"]  # reported for static too ({}: computed in float)
    if not calibrated.header["backend_meta"]["unfused_qdq"]:  # x86 with VNNI, ARM: int8 GEMMs, bar the pooler's Gemm
        assert ops == {"MatMulIntegerToFloat": 12}, ops  # was 4: residual-add Q/DQ pairs shared with GEMM inputs
    else:
        assert ops == {}
    assert calibrated.info["accuracy"]["on"] == "calibration data"
    # a CNN keeps static: dynamic int8 would leave its convolutions float
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 8))
    with pytest.warns(UserWarning, match="without calibration data"):
        eng = Builder(precision="int8", backend="onnxruntime").build(cnn, torch.randn(2, 1, 8, 8))
    assert eng.header["config"]["int8_activations"] == "static" and "convolutions" in eng.info["int8"]["why"]


def test_dynamic_uses_calibration_batches_only_for_the_accuracy_record() -> None:
    model = _bert()
    eng = Builder(BuildConfig(precision="int8", backend="onnxruntime", profiles=PROFILES,
                              int8_activations="dynamic")).build(model, calib=_calib())
    acc = eng.info["accuracy"]
    assert eng.header["config"]["int8_activations"] == "dynamic"
    assert acc["on"] == "calibration data" and acc["batches"] == 3 and acc["passed"] is True


def test_best_tries_dynamic_int8_without_calibration() -> None:
    eng = Builder(BuildConfig(precision="best", backend="onnxruntime", profiles=PROFILES,
                              int8_activations="dynamic")).build(_bert())
    times = eng.header["best"]["candidates_ms"]
    assert set(times) == {"fp32", "int8"} and all(isinstance(v, float) for v in times.values()), times


def test_cli_int8_activations_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tiny.py").write_text(
        "import torch, transformers\n"
        "def bert():\n"
        "    torch.manual_seed(0)\n"
        "    return transformers.BertModel(transformers.BertConfig(hidden_size=64, num_hidden_layers=2, "
        "num_attention_heads=4, intermediate_size=128, vocab_size=200))\n")
    monkeypatch.chdir(tmp_path)
    shapes = ["--minShapes", "input_ids:1x1,attention_mask:1x1", "--optShapes", "input_ids:2x16,attention_mask:2x16",
              "--maxShapes", "input_ids:4x48,attention_mask:4x48"]
    assert main(["build", "--model", "tiny.py:bert", *shapes, "--int8", "--int8-activations", "dynamic",
                 "--save-engine", "d.engine", "--json", "d.json"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("[I] int8 activations"))
    assert line.startswith("[I] int8 activations dynamic (per-token scales at run time") and "13 integer kernel(s)" in line
    assert "[I] accuracy vs fp32" in out and "backend onnxruntime" in out
    assert Engine.load(tmp_path / "d.engine").header["config"]["int8_activations"] == "dynamic"
    torch.save(_calib(), tmp_path / "calib.pt")
    assert main(["build", "--model", "tiny.py:bert", *shapes, "--int8", "--int8-activations", "static", "--calib",
                 "calib.pt", "--save-engine", "s.engine"]) == 0
    out = capsys.readouterr().out
    assert "[I] int8 activations static (per-tensor scales calibrated at build; asked for)" in out
    assert main(["build", "--model", "tiny.py:bert", *shapes, "--int8-activations", "dynamic",
                 "--save-engine", "f.engine"]) != 0  # fp32: the flag is for int8
    err = capsys.readouterr().err
    assert "--int8-activations 'dynamic' applies to int8 engines, but this build has --precision 'fp32'" in err
    assert main(["build", "--model", "tiny.py:bert", "--int8-activations", "per-token", "--save-engine", "x.engine"]) != 0


def test_impossible_combinations_are_refused_with_the_fix(digits_onnx: bytes) -> None:
    with pytest.raises(UsageError, match=r"int8_activations='dynamic' is for precision='int8': fp8 engines use calibrated per-tensor scales"):
        BuildConfig(precision="fp8", int8_activations="dynamic")
    with pytest.raises(UsageError, match=r"applies to int8 engines, but this build has precision='fp16'"):
        BuildConfig(precision="fp16", device="cuda", int8_activations="static")
    with pytest.raises(UsageError, match=r"int8_activations='per-token' is not one of static, dynamic"):
        BuildConfig(precision="int8", int8_activations="per-token")
    src = from_module(_bert(), NAMES)
    with pytest.raises(UsageError, match=r"dynamic int8 runs on ONNX Runtime's CPU provider; on CUDA build static"):
        int8_mode.resolve("dynamic", backends.get("onnxruntime"), torch.device("cuda"), src, None)
    assert int8_mode.resolve(None, backends.get("onnxruntime"), torch.device("cuda"), src, None)[0] == "static"
    with pytest.raises(UsageError, match=r"--int8-activations dynamic: .*tensorrt"):
        int8_mode.resolve("dynamic", backends.get("tensorrt"), torch.device("cpu"), src, None)
    # a Q/DQ model carries static scales
    from overdrive.engine.onnx import quantize_onnx

    qdq = quantize_onnx(digits_onnx, [(torch.randn(4, 1, 8, 8),)], "int8")
    with pytest.raises(UsageError, match=r"quantized already .* its activation scales are static"):
        Builder(precision="int8", backend="onnxruntime", int8_activations="dynamic").build(qdq, torch.randn(4, 1, 8, 8))
    # nothing for dynamic int8 to quantize
    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())
    with pytest.raises(UsageError, match=r"quantizes the weights of MatMul and Gemm layers .* --int8-activations static"):
        Builder(precision="int8", backend="onnxruntime", int8_activations="dynamic").build(conv, torch.randn(2, 1, 8, 8))
