"""Quantization recipes on overdrive.train.Trainer: QAT, and the accuracy recipe as one table (fp32 vs
int8 PTQ with every calibrator vs fp8 vs partial vs QAT).

Used by the demo's quant stage and by benchmarks/quant_accuracy.py, so both report the same rows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.quant import api
from overdrive.quant.config import FP8_DEFAULT, INT8_DEFAULT

if TYPE_CHECKING:
    from overdrive._utils.table import Table


def accuracy_table(
    title: str,
    model: nn.Module,
    base: float,
    calib: list[torch.Tensor],
    train_data: Iterable[Any],
    eval_data: Iterable[Any],
    qat_epochs: int,
    qat_lr: float,
    partial_k: int = 1,
    device: torch.device | str | None = None,
) -> tuple[Table, nn.Module, list[dict[str, Any]]]:
    """Run Wu et al.'s recipe on a copy of ``model`` and tabulate test accuracy against ``base``.

    Returns the table, the int8 model after QAT, and the sensitivity ranking.

    Example:
        >>> # table, int8, ranking = accuracy_table("digits", model, 0.99, calib, train, test, 1, 3e-5)
    """
    from overdrive._utils.table import Table
    from overdrive.train import evaluate

    def acc(m: nn.Module) -> float:
        return evaluate(m, eval_data)[1]

    def loop(m: nn.Module) -> None:
        for x in calib:
            m(x)

    t = Table(title, ["model", "calibration", "test accuracy", "vs fp32 (points)"])
    t.rows.append(["fp32", "-", base, 0.0])
    int8 = api.quantize(copy.deepcopy(model), INT8_DEFAULT, forward_loop=loop)
    rows = api.compare_calibrators(int8, acc)  # one calibration pass, every method from its histograms
    for r in rows:
        t.rows.append(["int8 PTQ", r["label"] + (" (best)" if r.get("best") else ""), r["metric"],
                       100 * (r["metric"] - base)])
    best = max(rows, key=lambda r: r["metric"])
    fp8 = api.quantize(copy.deepcopy(model), FP8_DEFAULT, forward_loop=loop)
    a = acc(fp8)
    t.rows.append(["fp8 e4m3 PTQ", "max", a, 100 * (a - base)])
    ranking = api.sensitivity(int8, acc)
    kept = api.partial_quantize(int8, ranking, k=partial_k)
    a = acc(int8)
    t.rows.append([f"int8 partial ({', '.join(kept)} in float)", best["label"], a, 100 * (a - base)])
    api.set_quantizers_enabled(int8, True)
    res = qat(int8, train_data, epochs=qat_epochs, lr=qat_lr, eval_data=eval_data, device=device)
    a = res.history[-1].eval_accuracy
    t.rows.append([f"int8 QAT ({qat_epochs} epoch(s), lr {qat_lr:g}, cosine)", best["label"], a, 100 * (a - base)])
    return t, int8, ranking


def qat(model: nn.Module, train_data: Iterable[Any], epochs: int, lr: float, eval_data: Iterable[Any] | None = None,
        policy: Any = "O0", device: torch.device | str | None = None, weight_decay: float = 0.0,
        progress: bool = False, attach: Callable[[torch.optim.Optimizer], Any] | None = None) -> Any:
    """Quantization-aware fine-tuning of a calibrated model (amax fixed, STE gradients).

    The recipe (Wu et al. 2020): ~10% of the original epochs, ``lr`` about 1% of the original
    initial LR, cosine decay. Uses overdrive.train.Trainer (and so overdrive.amp's ``policy``).
    ``attach(optimizer)`` is called on the optimizer before training, e.g. ``attach=handle.attach``
    of an overdrive.sparsity handle keeps 2:4 masks through QAT. Returns the Trainer's FitResult.
    """
    from overdrive.train import Trainer

    for _, q in api.quantizers(model):
        if q.enabled and not q.is_calibrated:
            raise UsageError(f"quantizer {q.name} is not calibrated; calibrate (quant.quantize with forward_loop) "
                             "before QAT")
    if epochs < 1 or not math.isfinite(lr) or lr <= 0:
        raise UsageError(f"QAT needs epochs >= 1 and lr > 0, got epochs={epochs}, lr={lr}")
    steps = epochs * len(train_data)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if attach is not None:
        attach(opt)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    trainer = Trainer(model, opt, policy=policy, device=device, scheduler=sched, progress=progress)
    return trainer.fit(train_data, epochs=epochs, eval_data=eval_data, description="QAT")
