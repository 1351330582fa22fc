"""Demo stage: build an engine for the trained digits model, exec it (trtexec-style), compare it with
PyTorch, and check accuracy on the test set through the engine. fp32 always; int8 when overdrive.quant
is available (Q/DQ ONNX -> onnxruntime on CPU, real int8 modules -> Inductor on CUDA)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from overdrive.demo.context import DemoContext
from overdrive.demo.report import Table
from overdrive.engine import Builder, Engine, ShapeProfile, compare


def _accuracy(engine: Engine, ctx: DemoContext) -> float:
    x, y = ctx.digits.x_test, ctx.digits.y_test
    correct = 0
    for i in range(0, len(x), 64):
        correct += int((engine(x[i:i + 64]).cpu().argmax(1) == y[i:i + 64]).sum())
    return correct / len(x)


def run(ctx: DemoContext) -> Table:
    from overdrive.demo.amp_stage import train_digits

    model = ctx.fp32_model
    if model is None:
        model, _, _ = train_digits(ctx, "O0")
    model = model.eval().cpu()
    profile = [ShapeProfile("x", (1, 1, 8, 8), (64, 1, 8, 8), (64, 1, 8, 8))]
    table = Table(f"Engines (overdrive.engine) for the digits CNN, {ctx.device.type}",
                  ["precision", "backend", "accuracy", "max err", "compare", "img/s bs64", "build s", "load s"])
    precisions = ["fp32"]
    try:
        from overdrive import quant  # noqa: F401

        precisions.append("int8")
    except ImportError:
        table.notes.append("int8: skipped, overdrive.quant is not available in this build")
    calib = [(b,) for b in ctx.digits.x_train[:512].split(64)]
    with tempfile.TemporaryDirectory() as tmp:
        for prec in precisions:
            t0 = time.perf_counter()
            try:
                eng = Builder(precision=prec, device=str(ctx.device), profiles=profile).build(model, calib=calib)
            except Exception as exc:
                table.notes.append(f"{prec}: build failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            build_s = time.perf_counter() - t0
            path = Path(tmp) / f"digits_{prec}.engine"
            eng.save(path)
            loaded = Engine.load(path)
            r = compare(loaded, model, inputs=(ctx.digits.x_test[:64],), atol=1e-3 if prec == "fp32" else 0.5, rtol=1e-3)
            s = loaded.benchmark(duration_s=0.5, iterations=20, warmup_ms=50, percentiles=(90, 99))
            table.rows.append([prec, f"{loaded.info['backend']}", _accuracy(loaded, ctx), r["outputs"][0]["max_abs"],
                               "PASSED" if r["passed"] else "FAILED", s["throughput_samples_s"], build_s, loaded.load_s])
            ctx.artifacts[f"engine_{prec}"] = loaded
            kernels = loaded.header["backend_meta"].get("int8_kernels")
            if kernels:  # why an int8 engine may be slower than fp32 on this CPU
                table.notes.append(f"{prec}: {kernels}")
    table.notes.append(f"PyTorch fp32 test accuracy {ctx.fp32_accuracy}; max err: max |engine - PyTorch| logit on 64 test "
                       "images; backend 'auto' "
                       f"({'ONNX Runtime on CPU' if ctx.device.type == 'cpu' else 'Inductor + CUDA graphs on GPU'}); "
                       "throughput from `engine.benchmark` (trtexec-style, with H2D/D2H on GPU)")
    return table
