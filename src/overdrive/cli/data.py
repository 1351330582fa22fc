"""``overdrive data``: benchmark the image pipelines on a dataset, or write a benchmark dataset."""

from __future__ import annotations

import click

from overdrive.cli.common import check_device, check_json_target, check_output, console, json_option, write_json


@click.group("data")
def command() -> None:
    """GPU image pipeline tools.

    \b
    Examples:
      overdrive data make-dataset imgs -n 512 --processes 2
      overdrive data bench imgs --workers 0 --workers 2 --batch-size 64
    """


@command.command("bench")
@click.argument("source", type=click.Path(exists=True))
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--size", default=224, show_default=True, type=click.IntRange(min=1), help="Output side in pixels.")
@click.option("--workers", "workers", multiple=True, type=click.IntRange(min=0), help="CPU worker counts to try (repeatable; default 0 and 4, capped at the usable cores).")
@click.option("--batches", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed batches per pipeline, rounded up to a multiple of its workers / GPU threads "
                   "(after one discarded warm-up batch per worker / thread).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--eval", "eval_mode", is_flag=True, help="Validation transform (resize + center crop) instead of training.")
@json_option("the results")
def bench(source: str, batch_size: int, size: int, workers: tuple[int, ...], batches: int, device: str, eval_mode: bool,
          json_path: str | None) -> None:
    """img/s of the CPU pipeline (N workers) vs the GPU pipeline on the images in SOURCE.

    \b
    Example:
      overdrive data bench imgs --workers 2 --batch-size 64 --json bench.json   # or an ImageFolder: train/
    """
    check_json_target(json_path)
    check_device("--device", device)
    from overdrive.data import bench as run_bench
    from overdrive.data.config import default_workers

    rows = run_bench(source, batch_size=batch_size, size=size, workers=workers or (0, default_workers()), batches=batches,
                     device=device, train=not eval_mode)
    if json_path is not None:
        write_json(rows, json_path)
        if json_path == "-":
            return
    from rich.table import Table

    t = Table(title=f"overdrive data bench {source} (batch {batch_size}, {size}x{size})")
    for c in ("pipeline", "img/s", "vs best"):
        t.add_column(c, justify="left" if c == "pipeline" else "right")
    for r in rows:
        t.add_row(r["pipeline"], f"{r['img_per_s']:,.0f}", f"{r['vs_best']:.2f}")
    console().print(t)


@command.command("make-dataset")
@click.argument("root", type=click.Path())
@click.option("-n", "n", default=2000, show_default=True, type=click.IntRange(min=1), help="Number of JPEGs.")
@click.option("--classes", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--width", default=500, show_default=True, type=click.IntRange(min=1))
@click.option("--height", default=375, show_default=True, type=click.IntRange(min=1))
@click.option("--quality", default=90, show_default=True, type=click.IntRange(1, 100))
@click.option("--processes", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
def make_dataset(root: str, n: int, classes: int, width: int, height: int, quality: int, processes: int, seed: int) -> None:
    """Write N ImageNet-size JPEGs cut from scikit-image's sample photos into ROOT/class_XXX/.

    \b
    Example:
      overdrive data make-dataset imgs -n 512 --processes 2   # 5000 for a longer benchmark
    """
    check_output("ROOT", root, folder=True)  # ROOT is made, but no folder above it
    from overdrive.data import make_sample_dataset

    path = make_sample_dataset(root, n=n, classes=classes, size=(width, height), quality=quality, seed=seed,
                               processes=processes)
    console().print(f"wrote {n} JPEGs to {path}")
