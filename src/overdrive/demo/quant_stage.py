"""Demo stage: PTQ of the O0-trained digits CNN with every calibrator, fp8, partial PTQ, then QAT."""

from __future__ import annotations

import copy

import torch

from overdrive import quant
from overdrive.demo.context import DemoContext
from overdrive.demo.report import Table
from overdrive.train import evaluate


def run(ctx: DemoContext) -> Table:
    if ctx.fp32_model is None:
        raise RuntimeError("the quant stage needs the amp stage's O0 model (run_demo adds it)")
    _, test = ctx.digits.loaders(batch_size=ctx.batch_size, seed=ctx.seed)
    calib = [x.to(ctx.device) for x in ctx.digits.calibration_batches(n=8)]

    def acc(m: torch.nn.Module) -> float:
        return evaluate(m, test)[1]

    def loop(m: torch.nn.Module) -> None:
        for x in calib:
            m(x)

    base = ctx.fp32_accuracy if ctx.fp32_accuracy is not None else acc(ctx.fp32_model)
    table = Table(f"Quantization (overdrive.quant) on digits, {ctx.device.type}",
                  ["model", "calibration", "test accuracy", "vs fp32 (points)"])
    table.rows.append(["fp32", "-", base, 0.0])
    int8 = quant.quantize(copy.deepcopy(ctx.fp32_model), quant.INT8_DEFAULT, forward_loop=loop)
    rows = quant.compare_calibrators(int8, acc)  # one calibration pass, every method from its histograms
    for r in rows:
        table.rows.append(["int8 PTQ", r["label"] + (" (best)" if r.get("best") else ""), r["metric"],
                           100 * (r["metric"] - base)])
    best = max(rows, key=lambda r: r["metric"])
    fp8 = quant.quantize(copy.deepcopy(ctx.fp32_model), quant.FP8_DEFAULT, forward_loop=loop)
    a = acc(fp8)
    table.rows.append(["fp8 e4m3 PTQ", "max", a, 100 * (a - base)])
    ranking = quant.sensitivity(int8, acc)
    kept = quant.partial_quantize(int8, ranking, k=1)
    a = acc(int8)
    table.rows.append([f"int8 partial ({kept[0]} in float)", best["label"], a, 100 * (a - base)])
    quant.set_quantizers_enabled(int8, True)
    train, _ = ctx.digits.loaders(batch_size=ctx.batch_size, seed=ctx.seed + 1)
    qat_epochs = max(1, ctx.epochs // 8)  # Wu et al.: ~10% of the schedule, LR at 1% of the original
    result = quant.qat(int8, train, epochs=qat_epochs, lr=3e-5, eval_data=test, device=ctx.device)
    a = result.history[-1].eval_accuracy
    table.rows.append([f"int8 QAT ({qat_epochs} epoch, lr 3e-5, cosine)", best["label"], a, 100 * (a - base)])
    ctx.artifacts["quant_int8_model"] = int8
    table.notes.append("int8: activations per tensor, weights per output channel, residual-add inputs quantized "
                       "(TensorRT placement); every calibrator is computed from one pass over 8 batches.")
    worst = ", ".join(f"{r['layer']} ({100 * r['drop']:+.1f})" for r in ranking[:3])
    table.notes.append(f"most sensitive layers (accuracy drop in points when quantized alone): {worst}")
    return table
