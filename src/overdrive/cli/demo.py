"""``overdrive demo``: the whole path on scikit-learn's digits, a table per technique."""

from __future__ import annotations

import click

from overdrive.cli.common import console, write_json


@click.command("demo")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--opt-level", "opt_levels", multiple=True, help="Opt level(s) to train at (repeatable); default O0-O3.")
@click.option("--epochs", default=8, show_default=True, type=int, help="Training epochs per opt level.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=2),
              help="Training batch size (>= 2: BatchNorm needs two samples; the distributed stage splits it over 2 ranks).")
@click.option("--dtype", default=None, help="Half dtype: bf16 or fp16 (default fp16 on CUDA, bf16 on CPU).")
@click.option("--stage", "stages", multiple=True, help="Run only these stages (repeatable).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", default=None, metavar="FILE", help="Also write every table as JSON ('-' for stdout).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def command(device: str, opt_levels: tuple[str, ...], epochs: int, batch_size: int, dtype: str | None,
            stages: tuple[str, ...], seed: int, json_path: str | None, no_progress: bool) -> None:
    """Train, accelerate and compare a small CNN on real handwritten digits.

    \b
    Examples:
      overdrive demo
      overdrive demo --device cuda --opt-level O0 --opt-level O2 --json results.json
    """
    from overdrive.amp.config import OPT_LEVELS
    from overdrive.demo import run_demo

    out = console()
    tables = run_demo(
        device=device, opt_levels=opt_levels or OPT_LEVELS, epochs=epochs, batch_size=batch_size, dtype=dtype,
        stages=stages or None, seed=seed, progress=not no_progress and json_path != "-",
        on_table=None if json_path == "-" else (lambda t: out.print(t.render())),
    )
    if json_path is not None:
        import torch

        write_json({"torch": torch.__version__, "tables": [t.to_dict() for t in tables]}, json_path)
