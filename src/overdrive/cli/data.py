"""``overdrive data``: benchmark the image pipelines on a dataset, write a benchmark dataset, or tokenize text files."""

from __future__ import annotations

import click

from overdrive.cli.common import check_device, check_json_target, check_output, console, json_option, write_json


@click.group("data")
def command() -> None:
    """GPU image pipeline and tokenization tools.

    \b
    Examples:
      overdrive data make-dataset imgs -n 512 --processes 2
      overdrive data bench imgs --workers 0 --workers 2 --batch-size 64
      overdrive data tokenize corpus/ -t tokenizer.json --max-length 512 -o tokens.npz --json
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


@command.command("tokenize")
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@click.option("--tokenizer", "-t", "tokenizer", required=True, type=click.Path(exists=True),
              help="A tokenizer.json, or a folder a transformers fast tokenizer was saved to (save_pretrained).")
@click.option("--field", default="text", show_default=True,
              help="JSON Lines field ('outer.inner' for a nested one) or CSV/TSV column holding the texts.")
@click.option("--per", type=click.Choice(["line", "file"]), default="line", show_default=True,
              help="Plain text files: one text per line, or per file.")
@click.option("--max-length", type=click.IntRange(min=1), default=None, help="Truncate each text to this many tokens.")
@click.option("--no-special-tokens", is_flag=True, help="Leave out the tokens the tokenizer adds ([CLS], [SEP], ...).")
@click.option("--workers", type=click.IntRange(min=0), default=None,
              help="Processes (0: this one; default: one per core for large inputs).")
@click.option("--cache-dir", type=click.Path(), default=None, help="Cache the result here; a second run loads it.")
@click.option("--errors", type=click.Choice(["strict", "replace", "ignore"]), default="strict", show_default=True,
              help="Bytes that are not UTF-8: refuse the file, or read them as U+FFFD (replace) or not at all (ignore).")
@click.option("--output", "-o", type=click.Path(), default=None,
              help="Write the ids and offsets to this .npz (text i: ids[offsets[i]:offsets[i+1]]).")
@json_option("the summary")
def tokenize_cmd(sources: tuple[str, ...], tokenizer: str, field: str, per: str, max_length: int | None,
                 no_special_tokens: bool, workers: int | None, cache_dir: str | None, errors: str, output: str | None,
                 json_path: str | None) -> None:
    """Tokenize the texts in each SOURCE, in the order given: a .txt/.md (a text per line), .jsonl (a field),
    .csv/.tsv (a column) file, each possibly .gz, a folder of them, or a glob pattern (shards/*.jsonl.gz as the shell
    expands it, or quoted: 'shards/**/*.jsonl').

    \b
    Example:
      overdrive data tokenize corpus/ -t tokenizer.json --max-length 512 -o tokens.npz --json
    """
    import time
    from pathlib import Path

    check_json_target(json_path)
    check_output("--output", output)
    if output is not None and not output.endswith(".npz"):  # before the work, not after it
        raise click.BadParameter(f"{output!r}: expected a .npz path, e.g. tokens.npz", param_hint="--output")
    from overdrive._utils.errors import UsageError
    from overdrive.data import read_texts, tokenize

    tok: object = tokenizer
    if Path(tokenizer).is_dir():  # save_pretrained's folder: its truncation side and model_max_length apply
        if not (Path(tokenizer) / "tokenizer.json").is_file():
            raise UsageError(f"--tokenizer {tokenizer}: the folder holds no tokenizer.json; give a tokenizer.json, or "
                             "the folder a fast tokenizer was saved to (tokenizer.save_pretrained(folder))")
        from overdrive._utils.optional import require

        tok = require("transformers", extra="text", feature="a tokenizer folder").AutoTokenizer.from_pretrained(tokenizer)
    source = sources[0] if len(sources) == 1 else " ".join(sources)
    texts = read_texts(list(sources), field=field, per=per, errors=errors)
    if not texts:
        raise UsageError(f"{source}: no texts (its files are empty or hold only blank lines); give a file with text")
    t0 = time.perf_counter()
    out = tokenize(texts, tok, max_length=max_length, add_special_tokens=not no_special_tokens, num_workers=workers,
                   cache_dir=cache_dir)
    seconds = time.perf_counter() - t0
    if output is not None:
        out.save(output)
    lens = out.lengths()
    summary = {"source": sources[0] if len(sources) == 1 else list(sources), "texts": len(out),
               "tokens": int(lens.sum()), "mean_length": float(lens.mean()),
               "max_length": int(lens.max()), "from_cache": out.from_cache, "seconds": seconds,
               "texts_per_s": len(out) / seconds if seconds > 0 else None, "output": output}
    if json_path is not None:
        write_json(summary, json_path)
        if json_path == "-":
            return
    console().print(f"{summary['texts']:,} texts, {summary['tokens']:,} tokens (mean {summary['mean_length']:.1f}, "
                    f"longest {summary['max_length']}) in {seconds:.2f} s"
                    + (" from the cache" if out.from_cache else "") + (f"; wrote {output}" if output else ""))
