"""Demo stage: build engines for the trained model (fp32/fp16, int8, fp8 where the GPU has it), save and
load each, compare it with PyTorch, check accuracy on the test set through it, and time it against plain
PyTorch in the same run: eager, and ``torch.compile`` (mode "reduce-overhead" on a GPU)."""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch

from overdrive._utils.timing import median, time_fn
from overdrive.demo.context import DemoContext
from overdrive._utils.table import Table
from overdrive.engine import Builder, Engine, ShapeProfile, compare


def _accuracy(fn: Callable[[torch.Tensor], torch.Tensor], ctx: DemoContext, batch: int, pad: bool = False) -> float:
    """Test accuracy through ``fn`` in batches of ``batch``; ``pad``: a short last batch is filled up to ``batch``
    with its own first image (for a static-shape engine) and only its real rows are scored."""
    x, y = ctx.data.x_test, ctx.data.y_test
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb, n = x[i:i + batch], len(y[i:i + batch])
            if pad and n < batch:
                xb = torch.cat([xb, xb[:1].expand(batch - n, *xb.shape[1:])])
            correct += int((fn(xb.to(ctx.device)).float().cpu()[:n].argmax(1) == y[i:i + batch]).sum())
    return correct / len(x)


def _throughput(fn: Callable[[torch.Tensor], object], x: torch.Tensor, ctx: DemoContext) -> tuple[float, str]:
    """Images/s of ``fn`` on the device-resident batch ``x`` (median of CUDA-event or wall-clock timings), and the
    interquartile range of the timed calls as images/s ("slow-fast")."""
    with torch.no_grad():
        ts = sorted(time_fn(lambda: fn(x), ctx.device, warmup=5, repeat=30 if ctx.device.type == "cuda" else 10))
    q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
    return x.shape[0] / median(ts), f"{x.shape[0] / q3:,.0f}-{x.shape[0] / q1:,.0f}"


def _bench_batch(ctx: DemoContext, batch: int) -> torch.Tensor:
    """Real test images, repeated to ``batch``, on the device (never zeros: they can time faster)."""
    x = ctx.data.x_test
    reps = -(-batch // len(x))
    return x.repeat(reps, 1, 1, 1)[:batch].contiguous().to(ctx.device)


def layer_notes(prec: str, info: dict[str, Any]) -> list[str]:
    """The notes an int8/fp8 engine's row gets from its ``engine.info``: which layers ran on a low-precision kernel
    and which stayed float and why, and its whole-engine timing against its float twin with the engine kept.

    Example:
        >>> layer_notes("int8", {"layers": {"fc": "int8 GEMM (torch._int_mm)"}, "whole_engine": {
        ...     "why": "int8 1.20x float16 as a whole engine (1.000 ms against 1.200 ms)", "kept": "int8"}})[1]
        'int8 whole engine: int8 1.20x float16 as a whole engine (1.000 ms against 1.200 ms); kept int8'
    """
    from overdrive.engine.layer_choice import placement_summary

    notes = [f"{prec} {placement_summary(info['layers'])}"] if info.get("layers") else []
    whole = info.get("whole_engine")
    if whole:  # timed whole against its float twin at build (CUDA; a dynamic profile at its opt shape)
        notes.append(f"{prec} whole engine: {whole['why']}; kept {whole['kept']}")
    if info.get("float_build"):  # no low-precision layer left after the per-layer timing
        notes.append(f"{prec}: {info['float_build']}")
    return notes


def run(ctx: DemoContext) -> Table:
    from overdrive.demo.amp_stage import train_digits

    model = ctx.fp32_model
    if model is None:
        model, _, _ = train_digits(ctx, "O0")
    model = copy.deepcopy(model).eval().cpu()
    w, cuda = ctx.workload, ctx.device.type == "cuda"
    B, shape = w.infer_batch, w.input_shape
    # a GPU serving engine is built for its batch (static shapes, as trtexec builds by default): it then runs as one
    # CUDA graph; a dynamic 1..B profile ran 0.92x torch.compile there (benchmarks/results/engine_demo_variants.md)
    profile = [ShapeProfile.fixed("x", (B, *shape)) if cuda else ShapeProfile("x", (1, *shape), (B, *shape), (B, *shape))]
    n_cmp = B if cuda else 64  # images compare runs on: the engine's batch when its shape is fixed
    table = Table(f"Engines (overdrive.engine): {w.name}, {ctx.device.type}, batch {B}",
                  ["run", "backend", "test accuracy", "vs PyTorch fp32 (points)", "max err", "compare", "img/s",
                   "img/s IQR", "vs eager", "vs torch.compile", "vs float engine", "build s"], stage="engine")
    xb = _bench_batch(ctx, B)
    ref_acc = ctx.fp32_accuracy if ctx.fp32_accuracy is not None else _accuracy(model, ctx, B)

    # plain PyTorch, same run: what a user has without overdrive
    half = torch.float16 if cuda else None
    eager = copy.deepcopy(model).to(ctx.device)
    if cuda:
        eager = eager.to(dtype=half, memory_format=torch.channels_last)
    eager_fn = (lambda x: eager(x.to(half).contiguous(memory_format=torch.channels_last))) if cuda else eager
    eager_label = "PyTorch eager " + ("fp16 channels_last" if cuda else "fp32")
    base_tput, base_iqr = _throughput(eager_fn, xb, ctx)
    eager_acc = _accuracy(eager_fn, ctx, B)
    table.rows.append([eager_label, "-", eager_acc, 100 * (eager_acc - ref_acc), None, None, base_tput, base_iqr, 1.0,
                       None, None, None])
    mode = "reduce-overhead" if cuda else "default"
    t0 = time.perf_counter()
    compiled = torch.compile(eager, mode=mode)
    comp_fn = (lambda x: compiled(x.to(half).contiguous(memory_format=torch.channels_last))) if cuda else compiled
    comp_tput, comp_iqr = _throughput(comp_fn, xb, ctx)
    comp_s = time.perf_counter() - t0
    comp_acc = _accuracy(comp_fn, ctx, B)
    table.rows.append([f"torch.compile(mode={mode!r})" + (" fp16" if cuda else ""), "-", comp_acc,
                       100 * (comp_acc - ref_acc), None, None, comp_tput, comp_iqr, comp_tput / base_tput, 1.0, None,
                       comp_s])
    # a speed-up's accuracy change is against the baseline it is timed against (fp16 eager on a GPU, not fp32)
    table.add_speedup("torch.compile", comp_tput / base_tput, eager_label, 100 * (comp_acc - eager_acc))

    precisions = ["fp16" if cuda else "fp32", "int8"]
    if cuda and torch.cuda.get_device_capability(ctx.device) >= (8, 9):
        precisions.append("fp8")
    elif cuda:
        table.notes.append("fp8: skipped, it needs compute capability 8.9+ (Ada/Hopper)")
    calib = [(b,) for b in ctx.data.x_train[:512].split(64)]
    float_tput = float_acc = None
    with tempfile.TemporaryDirectory() as tmp:
        for prec in precisions:
            t0 = time.perf_counter()
            try:
                eng = Builder(precision=prec, device=str(ctx.device), profiles=profile).build(model, calib=calib)
            except Exception as exc:  # noqa: BLE001 - one precision failing still leaves the others' rows
                table.rows.append([f"engine {prec}", "-", None, None, None, "BUILD FAILED"] + [None] * 6)
                table.notes.append(f"{prec}: build failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            build_s = time.perf_counter() - t0
            path = Path(tmp) / f"model_{prec}.engine"
            eng.save(path)
            loaded = Engine.load(path)
            r = compare(loaded, model, inputs=(xb[:n_cmp].cpu(),), atol=1e-3 if prec == "fp32" else 0.5,
                        rtol=1e-3 if prec == "fp32" else 5e-2)
            tput, iqr = _throughput(loaded, xb, ctx)
            acc = _accuracy(loaded, ctx, B, pad=cuda)
            float_tput = float_tput or (tput if prec in ("fp16", "fp32") else None)
            float_acc = acc if float_acc is None and prec in ("fp16", "fp32") else float_acc
            vs_float = tput / float_tput if float_tput and prec in ("int8", "fp8") else None
            table.rows.append([f"engine {prec}", loaded.info["backend"], acc, 100 * (acc - ref_acc),
                               r["outputs"][0]["max_abs"], "PASSED" if r["passed"] else "FAILED", tput, iqr, tput / base_tput,
                               tput / comp_tput, vs_float, build_s])
            table.add_speedup(f"engine {prec}", tput / base_tput, eager_label, 100 * (acc - eager_acc))
            table.add_speedup(f"engine {prec}", tput / comp_tput, "torch.compile", 100 * (acc - comp_acc))
            if vs_float is not None:
                table.add_speedup(f"engine {prec}", vs_float, f"engine {precisions[0]}", 100 * (acc - float_acc))
            ctx.artifacts[f"engine_{prec}"] = loaded
            kernels = loaded.header["backend_meta"].get("int8_kernels")
            if kernels:  # why an int8 engine may be slower than fp32 on this CPU
                table.notes.append(f"{prec}: {kernels}")
            layout = loaded.header["backend_meta"].get("int8_layout_why")
            if layout:  # which Q/DQ layout ONNX Runtime runs, chosen by timing at build
                table.notes.append(f"{prec} layout: {loaded.header['backend_meta']['int8_layout']} ({layout})")
            table.notes.extend(layer_notes(prec, loaded.info))
    table.notes.append(
        f"PyTorch fp32 test accuracy {ref_acc:.4f}; max err: max |engine - PyTorch fp32| logit on {n_cmp} test images; "
        f"img/s: median of timed calls on a batch of {B} real test images already on the {ctx.device.type} (CUDA "
        "events on a GPU), the same for every row, 'img/s IQR' the middle half of those calls; backend 'auto' "
        f"({'ONNX Runtime on CPU' if not cuda else f'Inductor, one CUDA graph per engine, built for batch {B} on GPU'}); int8/fp8 calibrated on 512 "
        "training images (max), weights per channel.")
    if not cuda:
        from overdrive._utils.device import cpu_summary

        table.notes.append(f"CPU {cpu_summary()}: ONNX Runtime's int8 convolutions use VNNI/AMX dot products where "
                           "the CPU has them (without them its Q/DQ graph runs as dequantize + fp32: no int8 speed).")
    return table
