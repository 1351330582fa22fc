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
    table.notes.append("int8: activations per tensor, weights per output channel, residual-add inputs quantized "
                       "(TensorRT placement); every calibrator is computed from one pass over 8 batches.")
    n_test = int(ctx.data.x_test.shape[0])
    table.notes += tie_notes(table, ranking, n_test)  # relabels the PTQ rows: the chart's labels are taken after it
    add_accuracy_changes(table)
    return table


def add_accuracy_changes(table: Table) -> None:
    """Each quantized row's accuracy change for the report's chart, labelled as its row reads ("model
    (calibration)"); accuracy only (a NaN ratio): the engine stage times the int8/fp8 engines.

    Example:
        >>> t = Table("q", ["model", "calibration", "test accuracy", "vs fp32 (points)"],
        ...           [["fp32", "-", 0.9, 0.0], ["int8 PTQ", "max (tied best)", 0.9, 0.0]])
        >>> add_accuracy_changes(t); [(s["label"], s["accuracy_delta"]) for s in t.speedups]
        [('int8 PTQ (max (tied best))', 0.0)]
    """
    for row in table.rows[1:]:
        if isinstance(row[-1], float):
            table.add_speedup(f"{row[0]} ({row[1]})", float("nan"), "fp32", row[-1])


def tie_notes(table: Table, ranking: list[dict], n_test: int) -> list[str]:
    """Make ties visible: PTQ calibrators at the same best accuracy are all marked "(tied best)" instead of the
    first one alone "(best)", and layer sensitivities are given in points to 2 decimals and in test images
    (one image of ``n_test`` is 100 / n_test points), with a tie across every layer said in words.

    Example:
        >>> t = Table("q", ["model", "calibration", "test accuracy", "vs fp32 (points)"],
        ...           [["int8 PTQ", "max (best)", 0.5, 0.0], ["int8 PTQ", "mse", 0.5, 0.0]])
        >>> tie_notes(t, [{"layer": "fc", "drop": 0.0}, {"layer": "conv", "drop": 0.0}], 200)[0]
        'int8 PTQ: 2 calibrators tie at the best test accuracy (0.5000, the same 100 of 200 test images right): max, mse'
        >>> [r[1] for r in t.rows]
        ['max (tied best)', 'mse (tied best)']
    """
    notes: list[str] = []
    ptq = [r for r in table.rows if r[0] == "int8 PTQ" and isinstance(r[2], float)]
    if ptq:
        best = max(r[2] for r in ptq)
        tied = [r for r in ptq if round(r[2] * n_test) == round(best * n_test)]
        for r in ptq:
            label = str(r[1]).removesuffix(" (best)")
            r[1] = f"{label} (tied best)" if len(tied) > 1 and r in tied else (f"{label} (best)" if r in tied else label)
        if len(tied) > 1:
            names = ", ".join(str(r[1]).removesuffix(" (tied best)") for r in tied)
            notes.append(f"int8 PTQ: {len(tied)} calibrators tie at the best test accuracy ({best:.4f}, the same "
                         f"{round(best * n_test)} of {n_test} test images right): {names}")
    if ranking:
        images = [round(r["drop"] * n_test) for r in ranking]
        if len(set(images)) == 1:
            notes.append(f"layer sensitivity (accuracy drop when quantized alone): all {len(ranking)} layers tie at "
                         f"{100 * ranking[0]['drop']:+.2f} points ({images[0]:+d} of {n_test} test images), so the "
                         "partial row keeps the first in float")
        else:
            worst = ", ".join(f"{r['layer']} ({100 * r['drop']:+.2f} points, {i:+d} images)"
                              for r, i in zip(ranking[:3], images))
            notes.append(f"most sensitive layers (accuracy drop when quantized alone, of {n_test} test images): {worst}")
    return notes
