"""Quantization recipes on overdrive.train.Trainer: QAT, and the accuracy recipe as one table (fp32 vs
int8 PTQ with every calibrator vs fp8 vs partial vs QAT).

Used by the demo's quant stage and by benchmarks/quant_accuracy.py, so both report the same rows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError
from overdrive.amp.config import Policy
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


@dataclass(frozen=True)
class QATConfig(ConfigBase):
    """What :func:`qat` does: epochs, AdamW's ``lr`` and ``weight_decay`` (cosine decay over all steps), the
    amp ``policy`` (an ``overdrive.amp.Policy`` or an opt-level string, kept as given; in JSON a Policy is its
    dict), and whether a progress bar shows.

    ``epochs`` and ``lr`` have no default: the recipe (Wu et al. 2020) takes them from the original training,
    about 10% of its epochs and 1% of its initial LR.

    It lives here, with :func:`qat`, rather than in ``overdrive.quant.config``: it holds an amp Policy, and
    ``overdrive.quant`` may not import ``overdrive.amp`` (tests/test_layering.py), so only a module above both
    can turn a Policy's JSON back into a Policy.

    Example:
        >>> cfg = QATConfig(epochs=1, lr=1e-5, policy="O2")
        >>> QATConfig.from_json(cfg.to_json()) == cfg
        True
    """

    epochs: int
    lr: float
    weight_decay: float = 0.0
    policy: Policy | str = "O0"
    progress: bool = False

    def __post_init__(self) -> None:
        bad_epochs = isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1
        bad_lr = isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not math.isfinite(self.lr) \
            or self.lr <= 0
        if bad_epochs or bad_lr:
            raise UsageError(f"QAT needs epochs >= 1 and lr > 0, got epochs={self.epochs!r}, lr={self.lr!r}")
        if isinstance(self.weight_decay, bool) or not isinstance(self.weight_decay, (int, float)) \
                or not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise UsageError(f"weight_decay={self.weight_decay!r} must be a finite number >= 0 (AdamW's, e.g. 0.01)")
        if isinstance(self.policy, str):
            Policy(opt_level=self.policy)  # names the opt levels if the string is not one of them
        elif not isinstance(self.policy, Policy):
            raise UsageError(f"policy={self.policy!r} must be an opt level ('O0', 'O1', 'O2', 'O3') or an "
                             "overdrive.amp.Policy")
        if not isinstance(self.progress, bool):
            raise UsageError(f"progress={self.progress!r} must be True or False")

    @classmethod
    def _decode_field(cls, name: str, value: Any, hint: Any) -> Any:
        # to_dict wrote a Policy as its dict (the base encodes any config so); a string stays a string
        if name == "policy" and isinstance(value, Mapping):
            return Policy.from_dict(value)
        return super()._decode_field(name, value, hint)


def qat(model: nn.Module, train_data: Iterable[Any], epochs: int | None = None, lr: float | None = None,
        eval_data: Iterable[Any] | None = None, *, config: QATConfig | None = None,
        device: torch.device | str | None = None, attach: Callable[[torch.optim.Optimizer], Any] | None = None,
        **settings: Any) -> Any:
    """Quantization-aware fine-tuning of a calibrated model (amax fixed, STE gradients).

    The recipe (Wu et al. 2020): ~10% of the original epochs, ``lr`` about 1% of the original
    initial LR, cosine decay. Uses overdrive.train.Trainer (and so overdrive.amp's ``policy``).
    The settings are a :class:`QATConfig`, given as ``config``, as ``epochs`` / ``lr`` and keywords
    (``policy=``, ``weight_decay=``, ``progress=``) that replace its fields, or both; an unknown keyword
    is a UsageError naming the known ones. ``device`` is where training runs (the model moves there).
    ``attach(optimizer)`` is called on the optimizer before training, e.g. ``attach=handle.attach``
    of an overdrive.sparsity handle keeps 2:4 masks through QAT. Returns the Trainer's FitResult.

    Example:
        >>> # result = qat(calibrated, train_loader, epochs=1, lr=1e-5, policy="O2")
        >>> # result = qat(calibrated, train_loader, config=QATConfig(epochs=1, lr=1e-5, policy="O2"))
    """
    from overdrive.train import Trainer

    cfg = _qat_config(config, epochs, lr, settings)
    for _, q in api.quantizers(model):
        if q.enabled and not q.is_calibrated:
            raise UsageError(f"quantizer {q.name} is not calibrated; calibrate (quant.quantize with forward_loop) "
                             "before QAT")
    steps = cfg.epochs * len(train_data)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if attach is not None:
        attach(opt)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    trainer = Trainer(model, opt, policy=cfg.policy, device=device, scheduler=sched, progress=cfg.progress)
    return trainer.fit(train_data, epochs=cfg.epochs, eval_data=eval_data, description="QAT")


def _qat_config(config: QATConfig | None, epochs: int | None, lr: float | None, settings: dict[str, Any]) -> QATConfig:
    """``config`` with ``epochs`` / ``lr`` and the keyword settings replaced; without a config, epochs and lr
    are required."""
    if config is not None and not isinstance(config, QATConfig):
        raise UsageError(f"config={config!r} must be an overdrive.recipes.quant.QATConfig")
    given = {k: v for k, v in (("epochs", epochs), ("lr", lr)) if v is not None}
    if config is None:
        QATConfig._check_keys(settings)  # an unknown keyword first: it may be a misspelt epochs / lr
        missing = [k for k in ("epochs", "lr") if k not in given]
        if missing:
            raise UsageError(f"qat needs {' and '.join(missing)} (e.g. qat(model, data, epochs=1, lr=1e-5)), or "
                             "config=QATConfig(epochs=..., lr=...)")
        return QATConfig(**given, **settings)
    return config.replace(**given, **settings)
