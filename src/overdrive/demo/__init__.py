"""``overdrive demo``: the whole path on a real dataset, one stage and one table per technique.

Example:
    >>> # from overdrive.demo import run_demo; tables = run_demo(device="cpu", epochs=2)
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence

import torch

from overdrive._utils.device import resolve_device
from overdrive._utils.errors import UsageError
from overdrive.amp.config import OPT_LEVELS, parse_dtype
from overdrive.demo.context import DemoContext
from overdrive.demo.data import load_digits
from overdrive.demo.report import Table

# Stage name -> module (each has ``run(ctx) -> Table | list[Table]``), in the order they run.
STAGES: dict[str, str] = {
    "amp": "overdrive.demo.amp_stage",
    "quant": "overdrive.demo.quant_stage",
    "sparsity": "overdrive.demo.sparsity_stage",
    "engine": "overdrive.demo.engine_stage",
    "data": "overdrive.demo.data_stage",
    "distributed": "overdrive.demo.distributed_stage",
}


def run_demo(
    device: str = "auto",
    opt_levels: Sequence[str] = OPT_LEVELS,
    epochs: int = 8,
    batch_size: int = 64,
    dtype: str | torch.dtype | None = None,
    stages: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = True,
    on_table: Callable[[Table], None] | None = None,
) -> list[Table]:
    """Run the demo's stages and return their tables (``on_table`` sees each as it is ready)."""
    dev = resolve_device(device)
    for lvl in opt_levels:
        if lvl not in OPT_LEVELS:
            raise UsageError(f"opt level {lvl!r} is not one of {', '.join(OPT_LEVELS)}")
    if "O0" not in opt_levels:
        opt_levels = ("O0", *opt_levels)  # the baseline every other row is compared with
    if epochs < 1:
        raise UsageError(f"--epochs {epochs} must be >= 1")
    half = parse_dtype(dtype) or (torch.float16 if dev.type == "cuda" else torch.bfloat16)
    chosen = list(stages) if stages else list(STAGES)
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise UsageError(f"unknown demo stage(s) {unknown}; choose from {list(STAGES)}")
    if chosen and chosen[0] != "amp" and "amp" not in chosen:
        chosen = ["amp", *chosen]  # later stages start from the O0-trained model
    ctx = DemoContext(device=dev, dtype=half, digits=load_digits(seed=seed), epochs=epochs, batch_size=batch_size,
                      seed=seed, opt_levels=tuple(opt_levels), progress=progress)
    tables: list[Table] = []
    for name in chosen:
        t0 = time.perf_counter()
        out = importlib.import_module(STAGES[name]).run(ctx)
        for table in out if isinstance(out, list) else [out]:
            table.notes.append(f"stage '{name}' took {time.perf_counter() - t0:.1f} s")
            tables.append(table)
            if on_table is not None:
                on_table(table)
    return tables


__all__ = ["run_demo", "STAGES", "DemoContext", "Table"]
