"""Demo stage: prune the O0-trained digits CNN to 2:4, fine-tune with masks held, compare accuracy
and the size of the compressed checkpoint."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from overdrive.demo.context import DemoContext
from overdrive._utils.table import Table

FINETUNE_EPOCHS = 3  # a short fine-tune keeps the stage under 15 s on 2 CPU cores


def run(ctx: DemoContext) -> Table:
    from overdrive import quant
    from overdrive.sparsity import SparsityConfig as Config, from_pruned, save_compressed, sparse_quantize, sparsify
    from overdrive.recipes.sparsity import train
    from overdrive.train import evaluate

    if ctx.fp32_model is None:
        raise RuntimeError("the sparsity stage needs the amp stage's O0 model (run the 'amp' stage first)")
    from overdrive.demo.amp_stage import batches

    train_loader, test_loader = batches(ctx)
    dense_acc = ctx.fp32_accuracy if ctx.fp32_accuracy is not None else evaluate(ctx.fp32_model, test_loader)[1]
    model = copy.deepcopy(ctx.fp32_model).to(ctx.device)
    handle = sparsify(model, Config(permutation=True, permutation_budget_s=0.5))
    rep = handle.report(example_inputs=(ctx.example(1),))
    pruned_acc = evaluate(model.eval(), test_loader)[1]
    torch.manual_seed(ctx.seed)
    ft_acc = train(model, train_loader, test_loader, FINETUNE_EPOCHS, ctx.workload.lr / 3, ctx.device,
                   attach=handle.attach)
    handle.verify()
    with tempfile.TemporaryDirectory() as tmp:
        stats = save_compressed(handle, Path(tmp) / "model.sparse24.pt")
    # sparse-quantized: int8 PTQ (per-channel weights, max calibration) of a copy of the fine-tuned model
    sq_handle = from_pruned(copy.deepcopy(model).eval())
    calib = [x.to(ctx.device) for x in ctx.data.calibration_batches(n=2)]
    sq_model = sparse_quantize(sq_handle, quant.INT8_DEFAULT, lambda m: [m(x) for x in calib])
    sq_acc = evaluate(sq_model.eval(), test_loader)[1]
    ctx.artifacts["sparsity_model"] = model
    ctx.artifacts["sparsity_handle"] = handle
    table = Table(
        f"Prune 2:4, fine-tune (overdrive.sparsity): {ctx.workload.name}, {ctx.device.type}",
        ["model", "test accuracy", "vs dense (points)", "retained |w|", "pruned-weight bytes"], stage="sparsity",
    )
    dense_b, comp_b = stats["dense_weight_bytes"], stats["compressed_weight_bytes"]
    table.rows.append(["dense (O0)", dense_acc, 0.0, 1.0, dense_b])
    table.rows.append(["2:4 pruned, no fine-tune", pruned_acc, 100 * (pruned_acc - dense_acc), rep.retained_magnitude, comp_b])
    table.rows.append([f"2:4 + fine-tune ({FINETUNE_EPOCHS} epochs)", ft_acc, 100 * (ft_acc - dense_acc),
                       rep.retained_magnitude, comp_b])
    table.rows.append(["2:4 + fine-tune + int8 PTQ (fake-quant)", sq_acc, 100 * (sq_acc - dense_acc),
                       rep.retained_magnitude, None])
    for row in table.rows[1:]:  # accuracy deltas for the report; speed: see the notes
        table.add_speedup(row[0], float("nan"), "dense", row[2])
    table.notes.append(
        f"{len(rep.pruned)} layers pruned, {len(rep.skipped)} kept dense (shape rule: out % 8, in % 16); "
        f"{rep.weight_fraction_pruned:.0%} of weights and {rep.flop_fraction_pruned:.0%} of GEMM FLOPs pruned; "
        f"compressed storage {comp_b / dense_b:.2f}x of the dense weights (values + 2-bit indices)")
    if rep.retained_magnitude_unpermuted is not None:
        table.notes.append(f"channel permutation raised retained magnitude from {rep.retained_magnitude_unpermuted:.4f} "
                           f"to {rep.retained_magnitude:.4f}")
    table.notes.append("2:4 + int8: the fake-quantized weights keep 2 nonzeros per group of 4 (checked); they export "
                       "to ONNX Q/DQ and build into an overdrive.engine int8 engine still 2:4")
    convs = sum(isinstance(layer.module, torch.nn.Conv2d) for layer in handle.layers)
    table.notes.append(f"speed: {convs} of the {len(handle.layers)} pruned layers are convolutions, and torch has no 2:4 "
                       "convolution kernel (cuSPARSELt runs Linear GEMMs only), so on this model 2:4 buys size, not speed; "
                       "2:4 saves compute only on sparse tensor cores (sm80+), and on the H200 torch's cuSPARSELt path "
                       "beat dense only on very large fp16 GEMMs (1.31x) and lost at BERT/ViT-base sizes: see "
                       "benchmarks/results/sparsity.md")
    return table

