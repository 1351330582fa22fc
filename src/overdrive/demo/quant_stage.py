"""Demo stage: PTQ of the O0-trained digits CNN with every calibrator, fp8, partial PTQ, then QAT."""

from __future__ import annotations

from overdrive.demo.context import DemoContext
from overdrive._utils.table import Table
from overdrive.recipes.quant import accuracy_table
from overdrive.train import evaluate


def run(ctx: DemoContext) -> Table:
    if ctx.fp32_model is None:
        raise RuntimeError("the quant stage needs the amp stage's O0 model (run_demo adds it)")
    from overdrive.demo.amp_stage import batches

    _, test = batches(ctx)
    train, _ = batches(ctx, seed=ctx.seed + 1)
    calib = [x.to(ctx.device) for x in ctx.data.calibration_batches(n=8)]
    base = ctx.fp32_accuracy if ctx.fp32_accuracy is not None else evaluate(ctx.fp32_model, test)[1]
    qat_epochs = max(1, ctx.epochs // 8)  # Wu et al.: ~10% of the schedule, LR at 1% of the original
    table, int8, ranking = accuracy_table(
        f"Quantization (overdrive.quant): {ctx.workload.name}, {ctx.device.type}", ctx.fp32_model, base, calib, train, test,
        qat_epochs=qat_epochs, qat_lr=3e-5, partial_k=1, device=ctx.device,
    )
    ctx.artifacts["quant_int8_model"] = int8
    table.stage = "quant"
    for row in table.rows[1:]:  # accuracy only: the engine stage times the int8/fp8 engines
        if isinstance(row[-1], float):
            table.add_speedup(f"{row[0]} ({row[1]})", float("nan"), "fp32", row[-1])
    table.notes.append("int8: activations per tensor, weights per output channel, residual-add inputs quantized "
                       "(TensorRT placement); every calibrator is computed from one pass over 8 batches.")
    worst = ", ".join(f"{r['layer']} ({100 * r['drop']:+.1f})" for r in ranking[:3])
    table.notes.append(f"most sensitive layers (accuracy drop in points when quantized alone): {worst}")
    return table
