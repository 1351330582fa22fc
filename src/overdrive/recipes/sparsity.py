"""The ASP recipe as one visible loop: train dense, prune 2:4, fine-tune with the same schedule.

Used by the accuracy benchmark and the demo stage so both measure the same thing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from overdrive.sparsity.api import sparsify
from overdrive.sparsity.config import SparsityConfig as Config


@dataclass
class RecipeResult:
    dense_accuracy: float
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per (permutation, stage)
    models: dict[str, nn.Module] = field(default_factory=dict)


def train(model: nn.Module, train: DataLoader, test: DataLoader, epochs: int, lr: float, device: torch.device,
          attach: Callable[[torch.optim.Optimizer], Any] | None = None) -> float:
    """AdamW + OneCycle for ``epochs``; ``attach(optimizer)`` installs the sparsity hook. Returns test accuracy."""
    from overdrive.train import Trainer, evaluate

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    if attach is not None:
        attach(opt)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(train))
    Trainer(model, opt, policy="O0", device=device, scheduler=sched, progress=False).fit(train, epochs=epochs)
    return evaluate(model.eval(), test)[1]


def prune_and_finetune(dense: nn.Module, dense_accuracy: float, train_loader: DataLoader, test_loader: DataLoader,
                       epochs: int, lr: float, device: torch.device, permutations: tuple[bool, ...] = (False, True),
                       config: Config | None = None, seed: int = 0) -> RecipeResult:
    """For each permutation setting: prune a copy of ``dense`` (accuracy without fine-tuning), then
    fine-tune it with the dense run's schedule (``epochs``, ``lr``) while masks hold."""
    from overdrive.train import evaluate

    res = RecipeResult(dense_accuracy)
    base = config or Config()
    for perm in permutations:
        model = copy.deepcopy(dense).to(device)
        handle = sparsify(model, base.replace(permutation=perm))
        rep = handle.report()
        pruned_acc = evaluate(model.eval(), test_loader)[1]
        torch.manual_seed(seed)
        ft_acc = train(model, train_loader, test_loader, epochs, lr, device, attach=handle.attach)
        handle.verify()
        res.rows.append({"permutation": perm, "retained_magnitude": rep.retained_magnitude,
                         "pruned_accuracy": pruned_acc, "finetuned_accuracy": ft_acc,
                         "weights_pruned": rep.weight_fraction_pruned, "handle": handle})
        res.models[f"perm={perm}"] = model
    return res
