"""onnxruntime backend: round trip, outputs against PyTorch, dynamic profiles, bad inputs, int8 Q/DQ,
the trtexec-style summary, compare, and the CLI verbs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.cli.main import main
from overdrive.engine import Builder, Engine, ShapeProfile, compare

DYN = [ShapeProfile("x", (1, 1, 8, 8), (4, 1, 8, 8), (32, 1, 8, 8))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, digits_onnx: bytes) -> Path:
    path = tmp_path_factory.mktemp("ort") / "d.engine"
    Builder(device="cpu", profiles=DYN).build(digits_onnx).save(path)
    return path


def test_auto_picks_onnxruntime_on_cpu_and_says_why(saved: Path) -> None:
    info = Engine.load(saved).info
    assert info["backend"] == "onnxruntime" and "CPU" in info["backend_reason"]
    assert info["load_s"] is not None and info["load_s"] < 5


@pytest.mark.parametrize("batch", [1, 4, 32])
def test_outputs_match_pytorch_across_the_profile(saved: Path, digits: torch.nn.Module, batch: int) -> None:
    eng = Engine.load(saved)
    x = torch.randn(batch, 1, 8, 8)
    with torch.no_grad():
        ref = digits(x)
    torch.testing.assert_close(eng(x), ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(eng(x=x), ref, atol=1e-5, rtol=1e-4)


def test_bad_inputs(saved: Path) -> None:
    eng = Engine.load(saved)
    with pytest.raises(UsageError, match=r"shape \(33, 1, 8, 8\), outside the engine's profile"):
        eng(torch.randn(33, 1, 8, 8))
    with pytest.raises(UsageError, match=r"outside the engine's profile"):
        eng(torch.randn(2, 1, 9, 8))
    with pytest.raises(UsageError, match=r"has 3 dims \(2, 8, 8\) but the engine's input has 4"):
        eng(torch.randn(2, 8, 8))  # a wrong rank, not a profile miss
    with pytest.raises(UsageError, match=r"is torch.int64 but the engine expects torch.float32; pass it as .*to\(torch.float32\)"):
        eng(torch.zeros(2, 1, 8, 8, dtype=torch.long))
    with pytest.raises(UsageError, match=r"missing \['x'\], unknown \['image'\]"):
        eng(image=torch.randn(1, 1, 8, 8))
    with pytest.raises(UsageError, match="takes 1 input"):
        eng(torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8))


def test_fp16_is_refused_with_the_fix(digits_onnx: bytes) -> None:
    with pytest.raises(UsageError, match="use --backend inductor for fp16"):
        Builder(backend="onnxruntime", precision="fp16", device="cpu", profiles=DYN).build(digits_onnx)


def test_summary_is_consistent(saved: Path) -> None:
    eng = Engine.load(saved)
    s = eng.benchmark(inputs=(torch.randn(1, 1, 8, 8),), iterations=200, duration_s=0.3, warmup_ms=20)
    for key in ("latency_ms", "enqueue_ms", "h2d_ms", "compute_ms", "d2h_ms"):
        st = s[key]
        assert st["min"] <= st["median"] <= st["max"] and st["min"] <= st["p90"] <= st["p99"] <= st["max"]
    assert s["iterations"] >= 200 and s["total_host_walltime_s"] >= 0.3
    # batch-1 sequential runs: throughput is one over the mean latency (loop overhead aside)
    ratio = s["latency_ms"]["mean"] / 1e3 * s["throughput_qps"]
    assert 0.6 < ratio <= 1.0, ratio
    assert s["total_gpu_compute_time_s"] <= s["total_host_walltime_s"]


def _qdq_model() -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    wq = rng.integers(-127, 128, size=(16, 8)).astype(np.int8)
    ws = (rng.random(8) * 0.01 + 0.005).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    inits = [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"), numpy_helper.from_array(b, "b"),
             numpy_helper.from_array(np.array(0.05, np.float32), "xs"), numpy_helper.from_array(np.array(0, np.int8), "xz"),
             numpy_helper.from_array(np.zeros(8, np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q_x"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], name="dq_w", axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["mm"], name="fc"),
             helper.make_node("Add", ["mm", "b"], ["pre"], name="bias"),
             helper.make_node("Relu", ["pre"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString(), wq, ws, b


def _qdq_reference(x: np.ndarray, wq: np.ndarray, ws: np.ndarray, b: np.ndarray) -> np.ndarray:
    xd = np.clip(np.round(x / 0.05), -128, 127) * 0.05  # symmetric int8, zero point 0
    return np.maximum(xd @ (wq.astype(np.float32) * ws) + b, 0)


def test_int8_qdq_engine(tmp_path: Path) -> None:
    model, wq, ws, b = _qdq_model()
    eng = Builder(precision="int8", device="cpu",
                  profiles=[{"name": "x", "min": [1, 16], "opt": [8, 16], "max": [64, 16]}]).build(model)
    assert eng.info["backend"] == "onnxruntime" and eng.info["precision"] == "int8"
    eng.save(tmp_path / "q.engine")
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32) * 2
    out = Engine.load(tmp_path / "q.engine")(torch.from_numpy(x)).numpy()
    ref = _qdq_reference(x, wq, ws, b)
    # ORT's integer kernels may requantize the accumulator; allow 1e-2 of the output range
    np.testing.assert_allclose(out, ref, atol=1e-2 * np.abs(ref).max())


def test_compare_engine_vs_pytorch(saved: Path, digits: torch.nn.Module) -> None:
    r = compare(Engine.load(saved), digits, atol=1e-4, rtol=1e-4)
    assert r["passed"] and r["outputs"][0]["max_abs"] < 1e-4
    perturbed = copy.deepcopy(digits)
    with torch.no_grad():
        perturbed.fc2.bias[3] += 0.01  # one logit off by 0.01: must fail at atol 1e-4
    r = compare(Engine.load(saved), perturbed, atol=1e-4, rtol=1e-4)
    assert not r["passed"] and abs(r["outputs"][0]["max_abs"] - 0.01) < 1e-4


def test_cli_build_exec_compare(tmp_path: Path, digits_onnx: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    onnx_path = tmp_path / "d.onnx"
    onnx_path.write_bytes(digits_onnx)
    eng = tmp_path / "d.engine"
    assert main(["build", "--onnx", str(onnx_path), "--saveEngine", str(eng), "--minShapes", "x:1x1x8x8",
                 "--optShapes", "x:2x1x8x8", "--maxShapes", "x:8x1x8x8", "--device", "cpu"]) == 0
    assert "backend onnxruntime" in capsys.readouterr().out
    assert main(["exec", "--load-engine", str(eng), "--duration", "0.2", "--iterations", "20", "--json", "-",
                 "--export-times", str(tmp_path / "t.json")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["iterations"] >= 20 and summary["batch"] == 2 and summary["throughput_qps"] > 0
    times = json.loads((tmp_path / "t.json").read_text())
    assert len(times) >= 20 and {"latencyMs", "h2dMs", "computeMs", "d2hMs", "enqueueMs"} <= set(times[0])
    capsys.readouterr()
    assert main(["exec", "--load-engine", str(eng), "--duration", "0.1", "--shapes", "x:8x1x8x8"]) == 0
    out = capsys.readouterr().out
    for field in ("Throughput:", "Latency:", "Enqueue Time: n/a (cpu", "H2D Latency: n/a", "Compute Time (host wall time, CPU):",
                  "D2H Latency: n/a", "Total Host Walltime:", "Total Compute Time (CPU):", "batch 8"):
        assert field in out
    assert main(["compare", str(eng), str(onnx_path)]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["exec", "--load-engine", str(eng), "--shapes", "x:9x1x8x8"]) == 2
    assert main(["build", "--onnx", str(onnx_path), "--save-engine", str(eng), "--backend", "tensorrt", "--device", "cpu",
                 "--shapes", "x:2x1x8x8"]) == 1
    err = capsys.readouterr().err
    assert "trtexec --onnx=" in err and "--shapes=x:2x1x8x8" in err


def test_export_profile_per_node(saved: Path, tmp_path: Path) -> None:
    """--export-profile on an onnxruntime engine: ONNX Runtime's own profiler, one row per graph node of the
    optimized model, the warm-up run left out, each node counted once per timed run."""
    out = tmp_path / "p.json"
    assert main(["exec", "--load-engine", str(saved), "--duration", "0.05", "--iterations", "5",
                 "--export-profile", str(out)]) == 0
    head, *rows = json.loads(out.read_text())  # trtexec's leading {"count": N}, then one row per layer
    assert head == {"count": 10}
    import onnx

    graph_nodes = {n.name for n in onnx.load_from_string(Engine.load(saved).sections["onnx"]).graph.node}
    assert rows and {r["name"].rsplit(" (", 1)[0] for r in rows} <= graph_nodes
    assert all(r["count"] == 10 for r in rows)  # benchmark.profile's 10 iterations; the warm-up run is not counted
    assert rows == sorted(rows, key=lambda r: -r["timeMs"]) and abs(sum(r["percentage"] for r in rows) - 100) < 1e-6
    assert any("(Conv)" in r["name"] or "(FusedConv)" in r["name"] for r in rows)


def _injects_use_cache(fn):  # what Hugging Face's forward wrappers do (transformers 5)
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        kwargs.setdefault("use_cache", False)
        return fn(self, *args, **kwargs)
    return wrapper


class _HFStyleEncoder(torch.nn.Module):
    """Two named inputs, optional parameters after them, and a wrapper that injects a keyword argument:
    the legacy ONNX exporter fills every optional parameter positionally, which then collides."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 16)

    @_injects_use_cache
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, use_cache: bool | None = None) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        return h * attention_mask.unsqueeze(-1).to(h.dtype) if attention_mask is not None else h


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_hugging_face_style_forward_exports(precision: str) -> None:
    """A BERT int8 build on CPU failed with "BertModel.forward() got multiple values for argument
    'use_cache'": the inputs now reach the model by name."""
    torch.manual_seed(0)
    m = _HFStyleEncoder().eval()
    ids, mask = torch.randint(0, 50, (4, 12)), torch.ones(4, 12, dtype=torch.int64)
    mask[:, -3:] = 0
    prof = [ShapeProfile.fixed("input_ids", (4, 12)), ShapeProfile.fixed("attention_mask", (4, 12))]
    eng = Builder(precision=precision, device="cpu", backend="onnxruntime", profiles=prof).build(
        m, (ids, mask), input_names=["input_ids", "attention_mask"], calib=[(ids, mask)])
    with torch.no_grad():
        ref = m(ids, mask)
    tol = 1e-5 if precision == "fp32" else 0.05 * ref.abs().max().item()
    assert (eng(ids, mask) - ref).abs().max().item() <= tol


def test_int8_transformer_linear_matches_fake_quant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized Linear on a 3-D input (every transformer layer) through the onnxruntime int8 engine equals
    the fake-quant model. On x86 without VNNI, ORT's fused u8s8 kernels saturated and were off by 30% of the
    output range; there the engine now keeps Q/DQ unfused and says so in its info. The decision is made once
    at build and stored: a load neither re-parses the ONNX for Q/DQ nodes nor re-probes the CPU."""
    quant = pytest.importorskip("overdrive.quant")
    from overdrive.engine.backends import onnxruntime as ort_backend

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32)).eval()
    x = torch.randn(4, 24, 32) * 3
    q = quant.quantize(copy.deepcopy(m), quant.INT8_DEFAULT, lambda mm: mm(x))
    with torch.no_grad():
        fq = q(x)
    eng = Builder(precision="int8", device="cpu", backend="onnxruntime", profiles=[ShapeProfile.fixed("x", (4, 24, 32))]
                  ).build(q, (x,), input_names=["x"])
    assert (eng(x) - fq).abs().max().item() <= 1e-3 * fq.abs().max().item()
    exact, why = ort_backend.int8_kernels_exact()
    assert eng.header["backend_meta"]["int8_kernels"].startswith("fused" if exact else "not fused") and why
    assert eng.header["backend_meta"]["unfused_qdq"] is (not exact)
    eng.save(tmp_path / "q.engine")

    def fail(*a: object, **k: object) -> None:
        raise AssertionError("load re-parsed the model or re-probed the CPU")

    monkeypatch.setattr(ort_backend, "has_qdq", fail)
    monkeypatch.setattr(ort_backend, "int8_kernels_exact", fail)
    loaded = Engine.load(tmp_path / "q.engine")
    assert (loaded(x) - fq).abs().max().item() <= 1e-3 * fq.abs().max().item()
