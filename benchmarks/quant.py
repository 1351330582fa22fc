"""overdrive.quant speed: int8 / fp8 GEMMs and Linear layers vs bf16, end-to-end BERT-base and
ResNet-50 with real int8 / fp8 modules vs bf16 eager, and ONNX Runtime int8 vs fp32 on CPU.

Full mode (the H200; well under the 4-minute budget of scripts/gpu_quant.sh):
    python3 benchmarks/quant.py
Quick mode (any machine, CPU included, < 60 s; small shapes):
    python3 benchmarks/quant.py --quick

Writes benchmarks/results/quant.json and quant.md (device, torch version, date, command line).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from overdrive import quant  # noqa: E402
from overdrive._utils.device import supports_fp8  # noqa: E402
from overdrive._utils.timing import time_fn  # noqa: E402
from overdrive.demo.report import Table  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import device_facts, write_results  # noqa: E402

FULL_SHAPES = [  # (tokens M, in K, out N): transformer projections / FFNs
    (4096, 768, 3072),  # BERT-base FFN up
    (8192, 1024, 4096),  # BERT-large FFN up
    (16384, 4096, 4096),  # 7B-class attention projection
    (16384, 4096, 14336),  # 7B-class FFN up
    (32768, 4096, 4096),
    (8192, 8192, 8192),
]
QUICK_SHAPES = [(256, 256, 512), (512, 512, 512)]


def bench(fn, device: torch.device, warmup: int, repeat: int) -> float:
    """Median seconds per call: CUDA events on GPU, perf_counter on CPU."""
    return statistics.median(time_fn(fn, device, warmup=warmup, repeat=repeat))


def _rotating(make, n: int):
    """``n`` input sets used in turn (small ones would otherwise sit in L2)."""
    bufs = [make() for _ in range(n)]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % n
        return bufs[state["i"]]
    return nxt


def gemm_table(device: torch.device, shapes, warmup: int, repeat: int) -> Table:
    fp8 = supports_fp8(device)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    t = Table(f"GEMM / Linear at transformer shapes ({'bf16' if device.type == 'cuda' else 'fp32'} baseline), {device.type}",
              ["M x K x N", "baseline ms", "baseline TFLOP/s", "int8 _int_mm x", "Int8Linear x",
               "fp8 tensor x", "fp8 row x", "Fp8Linear x", "Fp8Linear row x"])
    for m, k, n in shapes:
        flops = 2 * m * k * n
        rot = max(1, min(8, (64 << 20) // (m * k * 2) + 1))
        xs = _rotating(lambda: torch.randn(m, k, device=device, dtype=half), rot)
        w = torch.randn(n, k, device=device, dtype=half) / k ** 0.5
        lin = torch.nn.Linear(k, n, device=device, dtype=half)
        base = bench(lambda: F.linear(xs(), w), device, warmup, repeat)
        row = [f"{m} x {k} x {n}", base * 1e3, flops / base / 1e12]
        # int8: the GEMM alone on pre-quantized operands, then the whole module (activation quant + rescale)
        xq = _rotating(lambda: torch.randint(-128, 128, (m, k), device=device, dtype=torch.int8), rot)
        wq = torch.randint(-128, 128, (n, k), device=device, dtype=torch.int8)
        row.append(base / bench(lambda: torch._int_mm(xq(), wq.t()), device, warmup, repeat))
        calib = xs()
        q8 = quant.to_real(quant.quantize(copy.deepcopy(lin), quant.INT8_DEFAULT, forward_loop=lambda mod: mod(calib)))
        row.append(base / bench(lambda: q8(xs()), device, warmup, repeat))
        if fp8:
            xf = _rotating(lambda: torch.randn(m, k, device=device).to(torch.float8_e4m3fn), rot)
            wf = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
            row.append(base / bench(lambda: torch._scaled_mm(xf(), wf.t(), one, one, out_dtype=torch.bfloat16),
                                    device, warmup, repeat))
            row.append(base / bench(lambda: torch._scaled_mm(xf(), wf.t(), sa, sb, out_dtype=torch.bfloat16),
                                    device, warmup, repeat))
            qf = quant.quantize(copy.deepcopy(lin), quant.FP8_DEFAULT, forward_loop=lambda mod: mod(calib))
            f8 = quant.to_real(copy.deepcopy(qf))
            f8r = quant.to_real(qf, rowwise=True)
            row.append(base / bench(lambda: f8(xs()), device, warmup, repeat))
            row.append(base / bench(lambda: f8r(xs()), device, warmup, repeat))
        else:
            row += [float("nan")] * 4
        t.rows.append(row)
        del xs, xq, w
    t.notes.append("x = speedup over the baseline F.linear measured in the same run (higher is better). "
                   "'_int_mm' / 'fp8 tensor' / 'fp8 row' time the GEMM alone on pre-quantized operands; "
                   "Int8Linear / Fp8Linear include quantizing the activation and rescaling the output.")
    if not fp8:
        t.notes.append("fp8 columns empty: fp8 _scaled_mm needs a CUDA GPU of compute capability 8.9+.")
    if device.type == "cuda":
        from overdrive.quant import real as _real

        steps = "eager (torch.compile failed, see the warning)" if _real._FUSED.failed else \
            f"fused, torch.compile ({len(_real._FUSED.compiled)} compiled steps)"
        t.notes.append(f"activation quantize / int8 rescale steps: {steps}.")
    return t


def _e2e_rows(name: str, model, inputs, device, warmup, repeat, unit: str, n_items: int, fp8: bool,
              calib_inputs) -> list[list]:
    rows = []
    base = bench(lambda: model(*inputs), device, warmup, repeat)
    rows.append([name, "bf16 eager" if device.type == "cuda" else "fp32 eager", n_items / base, 1.0, "-"])
    cfg_noadd = {"int8": quant.INT8_DEFAULT.replace(residual_add=False),
                 "fp8": quant.FP8_DEFAULT.replace(residual_add=False)}
    variants = [("int8", False)] + ([("fp8", False), ("fp8", True)] if fp8 else [])
    for fmt, rowwise in variants:
        m = quant.quantize(copy.deepcopy(model), cfg_noadd[fmt], forward_loop=lambda mod: mod(*calib_inputs))
        m = quant.to_real(m, rowwise=rowwise)
        report = m._overdrive_real
        conv = sum(1 for v in report.values() if v.startswith(fmt))
        t = bench(lambda: m(*inputs), device, warmup, repeat)
        rows.append([name, f"{fmt}{' rowwise' if rowwise else ''} (real)", n_items / t, base / t,
                     f"{conv}/{len(report)} layers low precision"])
        del m
    return rows


@torch.no_grad()
def e2e_table(device: torch.device, quick: bool, warmup: int, repeat: int) -> Table:
    from overdrive._utils.optional import is_available

    fp8 = supports_fp8(device)
    half = torch.bfloat16 if device.type == "cuda" else torch.float32
    t = Table(f"End to end, real int8 / fp8 modules vs {'bf16' if device.type == 'cuda' else 'fp32'} eager, {device.type}",
              ["model", "variant", "items/s", "speedup", "converted"])
    if is_available("transformers"):
        from transformers import BertConfig, BertModel

        cfg = BertConfig() if not quick else BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                                        intermediate_size=512)
        batch, seq = (256, 128) if not quick else (16, 64)
        torch.manual_seed(0)
        bert = BertModel(cfg, add_pooling_layer=False).to(device=device, dtype=half).eval()
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
        calib = torch.randint(0, cfg.vocab_size, (min(batch, 64), seq), device=device)
        name = f"BERT-{'base' if not quick else 'tiny'} seq {seq} bs {batch}"
        t.rows += _e2e_rows(name, bert, (ids,), device, warmup, repeat, "seq/s", batch, fp8, (calib,))
        del bert
    else:
        t.notes.append("BERT skipped: transformers is not installed (pip install 'overdrive[text]').")
    try:
        import torchvision

        torch.manual_seed(0)
        rn = torchvision.models.resnet50(weights=None).to(device=device, dtype=half).eval()
        rn = rn.to(memory_format=torch.channels_last)
        batch, res = (256, 224) if not quick else (8, 64)
        x = torch.randn(batch, 3, res, res, device=device, dtype=half).contiguous(memory_format=torch.channels_last)
        t.rows += _e2e_rows(f"ResNet-50 {res}px bs {batch}", rn, (x,), device, warmup, repeat, "img/s", batch, fp8,
                            (x[:32],))
        del rn
    except Exception as exc:  # noqa: BLE001 - torchvision missing or built for another torch
        t.notes.append(f"ResNet-50 skipped: torchvision unusable here ({type(exc).__name__}).")
    t.notes.append("Random weights (no download). Linear layers and 1x1 convs run int8 (torch._int_mm) or fp8 "
                   "(torch._scaled_mm) with static per-tensor activation scales (rowwise: dynamic per-token); "
                   "attention matmuls, 3x3/7x7 convs and layers with unsupported shapes stay in bf16.")
    return t


def ort_table(quick: bool) -> Table:
    """ONNX Runtime (CPU) int8 Q/DQ vs fp32 on the demo's digits CNN, batch 256."""
    import onnxruntime as ort

    from overdrive.recipes.models import DigitsCNN

    t = Table("ONNX Runtime CPU: digits CNN, int8 Q/DQ vs fp32", ["model", "batch", "ms", "samples/s", "speedup"])
    torch.manual_seed(0)
    model = DigitsCNN(width=64).eval()  # the demo's CNN, 4x wider so the convs dominate
    x = torch.rand(256, 1, 8, 8)
    tmp = ROOT / "benchmarks" / "results" / "_tmp_quant"
    tmp.mkdir(parents=True, exist_ok=True)
    fp32_path = tmp / "fp32.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (x[:1],), str(fp32_path), opset_version=17, dynamo=False, input_names=["input"],
                          output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    q = quant.quantize(copy.deepcopy(model), quant.INT8_DEFAULT, forward_loop=lambda m: m(x))
    int8_path = quant.export_onnx(q, (x[:1],), tmp / "int8.onnx")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    base = None
    for label, path in (("fp32", fp32_path), ("int8 Q/DQ", int8_path)):
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        feed = {"input": x.numpy()}
        s = bench(lambda: sess.run(None, feed), torch.device("cpu"), 3, 10 if quick else 30)
        base = base or s
        t.rows.append([label, 256, s * 1e3, 256 / s, base / s])
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    t.notes.append(f"{torch.get_num_threads()} intra-op threads; ORT folds Q/DQ around Conv/Gemm into QLinearConv / "
                   "QGemm-style integer kernels (ORT_ENABLE_ALL).")
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, runs anywhere in < 60 s")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip", action="append", default=[], choices=["gemm", "e2e", "ort"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    from overdrive._utils.device import resolve_device

    device = resolve_device(args.device)
    warmup, repeat = (2, 5) if args.quick else (10, 30)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tables: list[Table] = []
    if "gemm" not in args.skip:
        tables.append(gemm_table(device, QUICK_SHAPES if args.quick else FULL_SHAPES, warmup, repeat))
        print(tables[-1].to_markdown(), flush=True)
    if "e2e" not in args.skip:
        tables.append(e2e_table(device, args.quick, warmup, 3 if args.quick else 20))
        print(tables[-1].to_markdown(), flush=True)
    if "ort" not in args.skip:
        from overdrive._utils.optional import is_available

        if is_available("onnxruntime"):
            tables.append(ort_table(args.quick))
            print(tables[-1].to_markdown(), flush=True)
    meta = {**device_facts(device, None if argv is None else ["benchmarks/quant.py", *argv]), "quick": args.quick}
    stem = "quant_quick" if args.quick else "quant"
    write_results(stem, meta, tables=tables, title=f"overdrive.quant speed ({'quick' if args.quick else 'full'})",
                  out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
