"""Engines on the GPU: fp32/tf32/fp16/bf16 round trips (CUDA graphs for static profiles), dynamic
profiles, ONNX through the importer, the trtexec summary with copies, and device checks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.engine import Builder, Engine, ShapeProfile
from overdrive.engine.backends.inductor import GraphRunner

pytestmark = pytest.mark.gpu

STATIC = [ShapeProfile.fixed("x", (8, 1, 8, 8))]
DYN = [ShapeProfile("x", (1, 1, 8, 8), (8, 1, 8, 8), (64, 1, 8, 8))]
# error bound against the fp32 PyTorch model: fp32 strict, tf32 ~1e-3, halves ~1e-2 of the logit scale
TOL = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 2e-2, "bf16": 8e-2}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_round_trip_static_cuda_graphs(tmp_path: Path, digits: torch.nn.Module, precision: str) -> None:
    eng = Builder(precision=precision, device="cuda", backend="inductor", profiles=STATIC).build(digits)
    meta = eng.header["backend_meta"]
    assert eng.info["device"]["type"] == "cuda" and meta["cuda_graph"] == "whole" and meta["compile_mode"] == "default"
    eng.save(tmp_path / "e.engine")
    loaded = Engine.load(tmp_path / "e.engine")
    assert isinstance(loaded.runner, GraphRunner) and "one CUDA graph" in loaded.info["runtime"]
    xs = [torch.randn(8, 1, 8, 8) for _ in range(3)]
    with torch.no_grad():
        refs = [digits(x) for x in xs]
    outs = [loaded(x) for x in xs]  # outputs must survive the next CUDA-graph replay
    for o, r in zip(outs, refs):
        assert o.dtype == torch.float32 and o.device.type == "cuda"
        scale = r.abs().max().item()
        assert (o.cpu() - r).abs().max().item() <= TOL[precision] * max(scale, 1.0)
    with pytest.raises(UsageError, match="outside the engine's profile"):
        loaded(torch.randn(4, 1, 8, 8))


def test_whole_graph_runner_copies_inputs_in_and_refuses_other_shapes(digits: torch.nn.Module) -> None:
    """The runner replays one recorded graph: a new input tensor (other storage, other layout) is copied into the
    graph's buffer and gives its own output (reference: the fp32 model, fp32 engine to 1e-4); a caller's input is
    never written to; another shape is refused by name instead of replaying on stale data."""
    eng = Builder(precision="fp32", device="cuda", profiles=STATIC).build(digits)
    runner = eng.runner
    assert isinstance(runner, GraphRunner)
    torch.manual_seed(0)
    for x in (torch.randn(8, 1, 8, 8), torch.randn(8, 8, 8, 1).permute(0, 3, 1, 2)):  # contiguous, then strided
        xd = x.cuda()
        kept = xd.clone()
        out = runner(xd)[0].clone()
        with torch.no_grad():
            ref = digits(x)
        assert torch.equal(xd, kept)
        assert (out.cpu() - ref).abs().max().item() <= 1e-4 * max(ref.abs().max().item(), 1.0)
    with pytest.raises(UsageError, match=r"recorded for \(8, 1, 8, 8\)"):
        runner(torch.randn(4, 1, 8, 8, device="cuda"))
    with pytest.raises(UsageError, match="takes 1 input"):
        runner()


def test_compile_mode_keeps_torch_compile_graphs(digits: torch.nn.Module) -> None:
    eng = Builder(precision="fp16", device="cuda", profiles=STATIC, compile_mode="reduce-overhead").build(digits)
    assert not isinstance(eng.runner, GraphRunner) and "cuda_graph" not in eng.header["backend_meta"]
    x = torch.randn(8, 1, 8, 8)
    with torch.no_grad():
        r = digits(x)
    assert (eng(x).cpu() - r).abs().max().item() <= 2e-2 * max(r.abs().max().item(), 1.0)


def test_dynamic_profile_and_onnx_import_on_gpu(digits: torch.nn.Module, digits_onnx: bytes) -> None:
    eng = Builder(precision="fp16", device="cuda", backend="inductor", profiles=DYN).build(digits_onnx)
    # dynamic profiles on CUDA record a CUDA graph per shape met, as torch.compile(mode="reduce-overhead") does
    assert eng.info["source"] == "onnx" and eng.header["backend_meta"]["compile_mode"] == "reduce-overhead"
    for b in (1, 8, 37, 64):
        x = torch.randn(b, 1, 8, 8)
        with torch.no_grad():
            r = digits(x)
        assert (eng(x).cpu() - r).abs().max().item() <= 2e-2 * max(r.abs().max().item(), 1.0)


def test_summary_with_copies(digits: torch.nn.Module) -> None:
    eng = Builder(precision="fp16", device="cuda", profiles=STATIC).build(digits)
    assert eng.info["backend"] == "inductor"
    s = eng.benchmark(iterations=100, duration_s=0.3, warmup_ms=50)
    assert s["h2d_ms"]["median"] > 0 and s["d2h_ms"]["median"] > 0 and s["compute_ms"]["median"] > 0
    lat = s["latency_ms"]["mean"]
    assert abs(lat - (s["h2d_ms"]["mean"] + s["compute_ms"]["mean"] + s["d2h_ms"]["mean"])) < 1e-3 * max(lat, 1)
    # a tiny model: host-side event bookkeeping per iteration can exceed the GPU time, hence the loose floor
    assert 0.05 < lat / 1e3 * s["throughput_qps"] <= 1.05
    s2 = eng.benchmark(iterations=100, duration_s=0.2, warmup_ms=50, no_data_transfers=True)
    assert s2["h2d_ms"]["max"] == 0 or s2["h2d_ms"]["median"] < s["h2d_ms"]["median"]


def test_cuda_engine_refuses_cpu(tmp_path: Path, digits: torch.nn.Module) -> None:
    Builder(precision="fp16", device="cuda", profiles=STATIC).build(digits).save(tmp_path / "g.engine")
    with pytest.raises(UsageError, match="engines are tied to the device"):
        Engine.load(tmp_path / "g.engine", device="cpu")
    with pytest.raises(UsageError, match="built for precision fp16, not bf16"):
        Engine.load(tmp_path / "g.engine", precision="bf16")


def test_int8_fp8_need_quant(digits: torch.nn.Module) -> None:
    quant = pytest.importorskip("overdrive.quant")
    if not hasattr(quant, "to_real"):
        pytest.skip("overdrive.quant without to_real")
    for prec in ("int8", "fp8"):
        eng = Builder(precision=prec, device="cuda", profiles=STATIC).build(digits, calib=[(torch.randn(8, 1, 8, 8),)])
        assert eng.header["backend_meta"]["float_remainder"] == "float16"  # trtexec --int8 --fp16, not fp32
        assert eng.header["backend_meta"]["freezing"] is True
        x = torch.randn(8, 1, 8, 8)
        with torch.no_grad():
            r = digits(x)
        assert (eng(x).cpu() - r).abs().max().item() <= 0.15 * max(r.abs().max().item(), 1.0)


def test_cli_torchscript_build_exec_compare_on_gpu(tmp_path: Path, digits: torch.nn.Module,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's three sources through the CLI on the GPU: TorchScript (through ONNX and the importer) and a
    PyTorch factory, fp16 with fp16 channels_last I/O; exec prints the summary; compare against the ONNX passes."""
    from overdrive.cli.main import main

    ts = tmp_path / "d.pt"
    torch.jit.trace(digits, torch.randn(8, 1, 8, 8)).save(str(ts))
    eng = tmp_path / "ts.engine"
    assert main(["build", "--torchscript", str(ts), "--saveEngine", str(eng), "--shapes", "input:8x1x8x8",
                 "--fp16", "--device", "cuda", "--inputIOFormats", "fp16:hwc"]) == 0
    assert "backend inductor" in capsys.readouterr().out
    assert main(["exec", "--load-engine", str(eng), "--iterations", "50", "--duration", "0.2", "--use-cuda-graph"]) == 0
    assert "GPU Compute Time" in capsys.readouterr().out
    onnx_path = tmp_path / "d.onnx"  # the same network as ONNX, run by ONNX Runtime (CPU) as the reference
    torch.onnx.export(digits, (torch.randn(8, 1, 8, 8),), str(onnx_path), dynamo=False, input_names=["input"],
                      opset_version=17)
    assert main(["compare", str(eng), str(onnx_path), "--atol", "5e-2", "--rtol", "5e-2"]) == 0
    assert "PASSED" in capsys.readouterr().out
    loaded = Engine.load(eng)
    x = torch.randn(8, 1, 8, 8)
    with torch.no_grad():
        r = digits(x)
    assert loaded.header["inputs"][0]["dtype"] == "float16"
    assert (loaded(x).float().cpu() - r).abs().max().item() <= 2e-2 * max(r.abs().max().item(), 1.0)


def _tiny_bert() -> tuple[torch.nn.Module, torch.Tensor]:
    """A 2-layer Hugging Face BERT (fp32, eval) and a (4, 32) batch of token ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=1000)
    return transformers.BertModel(cfg).eval(), torch.randint(0, 1000, (4, 32))


def test_bert_without_mask_input_drops_masks_on_gpu() -> None:
    """Hugging Face BERT built with input_ids only: the engine drops the all-ones masks (one per layer) and
    matches eager within bf16 tolerance; with an attention_mask input the masks stay and padding still masks."""
    bert, ids = _tiny_bert()
    mask = torch.ones(4, 32, dtype=torch.int64)
    mask[1, 20:] = 0
    with torch.no_grad():
        ref_ids, ref_mask = bert(input_ids=ids)[0], bert(input_ids=ids, attention_mask=mask)[0]
    one = Builder(precision="bf16", device="cuda", profiles=[ShapeProfile.fixed("input_ids", (4, 32))]).build(
        bert, (ids,), input_names=["input_ids"])
    assert one.header["backend_meta"]["attention_masks_dropped"] == 2
    assert (one(ids)[0].float().cpu() - ref_ids).abs().max().item() <= 5e-2 * ref_ids.abs().max().item()
    two = Builder(precision="bf16", device="cuda", profiles=[ShapeProfile.fixed("input_ids", (4, 32)),
                                                             ShapeProfile.fixed("attention_mask", (4, 32))]).build(
        bert, (ids, mask), input_names=["input_ids", "attention_mask"])
    assert two.header["backend_meta"]["attention_masks_dropped"] == 0
    assert (two(ids, mask)[0].float().cpu() - ref_mask).abs().max().item() <= 5e-2 * ref_mask.abs().max().item()


def test_bert_gemm_gelu_on_gpu() -> None:
    """--gemm-gelu (the CUDA default) on a tiny Hugging Face BERT in bf16: one GELU folded per layer into
    cuBLASLt's epilogue (its tanh form), outputs within bf16 tolerance of the fp32 model; --no-gemm-gelu
    keeps the GELUs."""
    bert, ids = _tiny_bert()
    with torch.no_grad():
        ref = bert(input_ids=ids)[0]
    for flag, fused in ((None, 2), (False, 0)):
        eng = Builder(precision="bf16", device="cuda", gemm_gelu=flag,
                      profiles=[ShapeProfile.fixed("input_ids", (4, 32))]).build(bert, (ids,), input_names=["input_ids"])
        assert eng.header["backend_meta"]["gemm_gelu_fused"] == fused
        assert (eng(ids)[0].float().cpu() - ref).abs().max().item() <= 5e-2 * ref.abs().max().item()


def test_best_on_gpu(digits: torch.nn.Module) -> None:
    """--best on the GPU times fp16 and bf16, plus int8 and fp8 when calibration data is given, and keeps the
    fastest."""
    x = torch.randn(8, 1, 8, 8)
    eng = Builder(precision="best", device="cuda", profiles=STATIC).build(digits, (x,), calib=[(x,)])
    times = eng.header["best"]["candidates_ms"]
    assert {"fp16", "bf16", "int8"} <= set(times)
    built = {p: v for p, v in times.items() if isinstance(v, float)}
    assert eng.header["precision"] == min(built, key=built.get)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_float_onnx_calibrated_on_gpu(digits: torch.nn.Module, digits_onnx: bytes, precision: str) -> None:
    """A float ONNX model with calibration batches: ONNX Runtime makes the Q/DQ model (fp8 at opset 19), the
    importer runs it under Inductor on the GPU, within the format's error of the fp32 model."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    g = torch.Generator().manual_seed(1)
    calib = [(torch.randn(8, 1, 8, 8, generator=g),) for _ in range(4)]
    eng = Builder(precision=precision, device="cuda", profiles=STATIC).build(digits_onnx, calib=calib)
    assert "quantize_static" in eng.header["calibration"]
    x = calib[0][0]
    with torch.no_grad():
        ref = digits(x)
    out = eng(x)
    out = (out[0] if isinstance(out, (list, tuple)) else out).float().cpu()
    assert (out - ref).abs().max().item() <= 0.15 * ref.abs().max().item()


def test_conv_fusion_on_gpu() -> None:
    """conv (+BN) (+add) + ReLU as one cuDNN call: a ResNet bottleneck with a projection shortcut in fp16
    channels_last. The pass alone (every match fused) compiled under CUDA graphs, and the engine (each shape fused
    where its timing says so, the CUDA default), within fp16 tolerance of the fp32 model; --no-conv-fusion fuses
    nothing; an fp8 build keeps it working in its fp16 remainder."""
    from overdrive.engine.conv_fusion import fuse_conv_relu

    from .test_conv_fusion import Bottleneck, _randomize_bn

    torch.manual_seed(0)
    m = _randomize_bn(Bottleneck(c=64, down=True)).eval()
    x = torch.randn(16, 64, 28, 28)
    with torch.no_grad():
        ref = m(x)
        half = copy.deepcopy(m).half().cuda().to(memory_format=torch.channels_last)
        xh = x.half().cuda().contiguous(memory_format=torch.channels_last)
        ep = torch.export.export(half, (xh,), strict=False)
        assert len(fuse_conv_relu(ep)) == 3
        fn = torch.compile(ep.module(), mode="reduce-overhead")
        for _ in range(3):
            out = fn(xh).float().cpu()
        assert (out - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    prof = [ShapeProfile.fixed("x", (16, 64, 28, 28))]
    for flag in (None, False):
        eng = Builder(precision="fp16", device="cuda", conv_fusion=flag, profiles=prof).build(m, (x,), input_names=["x"])
        meta = eng.header["backend_meta"]
        if flag is None:
            assert len(meta["conv_relu_timed"]) == 3  # three distinct shapes timed
            assert meta["conv_relu_fused"] == sum(v.startswith("fused") for v in meta["conv_relu_timed"])
        else:
            assert meta["conv_relu_fused"] == 0
        assert (eng(x).cpu() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    eng = Builder(precision="fp8", device="cuda", conv_fusion=True, profiles=prof).build(m, (x,), input_names=["x"],
                                                                                         calib=[(x,)])
    assert (eng(x).cpu() - ref).abs().max().item() <= 8e-2 * ref.abs().max().item()


def test_sibling_gemms_on_gpu() -> None:
    """Q/K/V as one GEMM on a tiny Hugging Face BERT in fp16: each group timed on the GPU (the CUDA default), the
    fused count equal to the groups it timed faster as one, outputs within fp16 tolerance of the fp32 model; with
    --sibling-gemms forced through the pass alone (every group fused) under CUDA graphs, the same tolerance."""
    from overdrive.engine.sibling_gemms import fuse_sibling_gemms

    bert, ids = _tiny_bert()
    with torch.no_grad():
        ref = bert(input_ids=ids)[0]
    eng = Builder(precision="fp16", device="cuda", profiles=[ShapeProfile.fixed("input_ids", (4, 32))]).build(
        bert, (ids,), input_names=["input_ids"])
    meta = eng.header["backend_meta"]
    assert len(meta["sibling_gemms_timed"]) == 1  # one group shape: 128 tokens x 3 projections
    assert meta["sibling_gemms_fused"] in (0, 2)  # both layers' groups, or neither (they share the shape)
    assert (eng(ids)[0].float().cpu() - ref).abs().max().item() <= 5e-2 * ref.abs().max().item()
    with torch.no_grad():
        half = copy.deepcopy(bert).half().cuda()
        ep = torch.export.export(half, (ids.cuda(),), strict=False)
        assert len(fuse_sibling_gemms(ep)) == 2
        fn = torch.compile(ep.module(), mode="reduce-overhead")
        for _ in range(3):
            out = fn(ids.cuda())[0].float().cpu()
    assert (out - ref).abs().max().item() <= 5e-2 * ref.abs().max().item()

