"""``overdrive demo``: the whole path on scikit-learn's digits, a table per technique."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from overdrive.cli.common import check_device, check_json_target, check_output, console, json_option, write_json

if TYPE_CHECKING:
    from overdrive._utils.table import Table


@click.command("demo")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--quick", is_flag=True,
              help="The tiny digits CNN on 8x8 images instead of a model sized for the device (about 40 s on 2 idle CPU "
                   "cores with every stage; tests/demo run each stage this way).")
@click.option("--opt-level", "opt_levels", multiple=True,
              help="Opt level(s) the amp stage trains at (repeatable); default O0-O3.")
@click.option("--epochs", default=None, type=int,
              help="Training epochs per opt level (default: the workload's, 8 with --quick).")
@click.option("--batch-size", default=None, type=click.IntRange(min=2),
              help="Training batch size (>= 2: BatchNorm needs two samples); default: the workload's.")
@click.option("--dtype", default=None,
              help="The amp stage's half dtype: bf16 or fp16 (default fp16 on CUDA, bf16 on CPU).")
@click.option("--stage", "stages", multiple=True, help="Run only these stages (repeatable).")
@click.option("--seed", default=0, show_default=True, type=int)
@json_option("every table")
@click.option("--report", "report_dir", default=None, metavar="DIR",
              help="Write DIR/report.md with PNG charts (speed-ups, accuracy deltas, loss curves); needs matplotlib.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def command(device: str, quick: bool, opt_levels: tuple[str, ...], epochs: int | None, batch_size: int | None,
            dtype: str | None, stages: tuple[str, ...], seed: int, json_path: str | None, report_dir: str | None,
            no_progress: bool) -> int:
    """Train, accelerate and compare a CNN on real handwritten digits, each technique against plain PyTorch.

    A stage that cannot run here, or fails, is a table that says so; the others still run. The last line
    lists what failed or was skipped; the exit code is 1 only when a stage failed. A flag that none of the
    chosen stages uses (--opt-level with --stage quant alone) is refused before any work.

    \b
    Examples:
      overdrive demo
      overdrive demo --quick
      overdrive demo --device cuda --report demo_report --json results.json
    """
    from overdrive.cli import common
    from overdrive.demo import run_demo, summary

    check_json_target(json_path)
    check_device("--device", device)
    check_output("--report", report_dir, folder=True)  # refuse before the work: a missing or unwritable folder
    _check_apart(json_path, report_dir)
    if report_dir is not None:  # or a missing matplotlib
        from overdrive._utils.optional import require

        require("matplotlib", extra="plot", feature="overdrive demo --report")
    out = console()
    done: list[Table] = []  # every table as it is ready: what a Ctrl-C keeps

    def shown(t: Table) -> None:
        done.append(t)
        if json_path != "-":
            out.print(t.render())

    try:
        tables = run_demo(
            device=device, opt_levels=opt_levels or None, epochs=epochs, batch_size=batch_size, dtype=dtype,
            stages=stages or None, seed=seed, progress=not no_progress and json_path != "-", on_table=shown,
            quick=quick, verbose=common.VERBOSE,
        )
    except KeyboardInterrupt:  # minutes of finished stages are not thrown away: save them, then exit as Ctrl-C
        if any(t.status != "interrupted" for t in done):  # nothing finished: an older --json/--report stays
            line = summary(done)[0]
            _save(done, line, device, quick, json_path, report_dir, out)
            _say(line, json_path, out)
        raise
    line, failed = summary(tables)
    _save(tables, line, device, quick, json_path, report_dir, out)
    _say(line, json_path, out)
    return 1 if failed else 0


def _check_apart(json_path: str | None, report_dir: str | None) -> None:
    """Refuse, before the work, a ``--json`` file that the ``--report`` folder would be or would overwrite: the
    same new path for both wrote the JSON there and then failed to make the folder (FileExistsError, no report);
    ``--json DIR/report.json`` was overwritten by the report's own report.json.

    Example:
        >>> _check_apart("out/report.json", "out")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --json out/report.json: the --report folder 'out' writes its own report.json there; give --json a path outside that folder, such as 'out.json'
    """
    import re
    from pathlib import Path

    from overdrive._utils.errors import UsageError

    if json_path in (None, "-") or report_dir is None:
        return
    j, r = Path(json_path).resolve(), Path(report_dir).resolve()
    bare = report_dir.rstrip("/\\")
    suggest = repr(f"{bare}.json" if Path(bare).name not in ("", ".", "..") else "results.json")
    if j == r:
        raise UsageError(f"--json {json_path} and --report {report_dir} are the same path: --report is a folder (of "
                         f"report.md, report.json and the charts); give --json another path, such as {suggest}")
    if j.parent == r and re.fullmatch(r"report\.(md|json)|speedups\.png|accuracy\.png|loss_.*\.png", j.name):
        raise UsageError(f"--json {json_path}: the --report folder {report_dir!r} writes its own {j.name} there; "
                         f"give --json a path outside that folder, such as {suggest}")


def _say(line: str, json_path: str | None, out: Any) -> None:
    """The summary line: on stdout after the tables, on stderr when stdout carries the JSON (bare ``--json``)."""
    if json_path != "-":
        out.print(line)
    else:
        click.echo(line, err=True)


def _save(tables: list[Table], line: str, device: str, quick: bool, json_path: str | None, report_dir: str | None,
          out: Any) -> None:
    """Write ``--json`` and ``--report`` for these tables (all of them, or those before a Ctrl-C), headed by
    the run's facts (device, torch, date, command, commit) and its summary ``line``."""
    import datetime
    import platform

    import torch

    from overdrive._utils.device import cpu_summary, resolve_device

    dev = resolve_device(device)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU {platform.machine()}",
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "cpu_features": cpu_summary(), "workload": "quick" if quick else "default",
            "command": _command(click.get_current_context(silent=True)),
            "git_commit": _git_commit(), "summary": line}
    if json_path is not None:
        write_json({**meta, "tables": [t.to_dict() for t in tables]}, json_path)
    if report_dir is not None:
        from overdrive.demo.plots import write_report

        path = write_report(tables, report_dir, meta)
        if json_path != "-":
            out.print(f"report: {path}")


def _command(ctx: click.Context | None) -> str:
    """The command line that reproduces this run, rebuilt from the options the demo parsed (those not at their
    default) and quoted for a POSIX shell. It was ``sys.argv`` joined with spaces: a report written from
    ``main(["demo", ...])`` in a notebook or a script named the kernel's or pytest's arguments, and ``--report
    "my run"`` came back as two arguments.

    Example:
        >>> ctx = command.make_context("demo", ["--quick", "--stage", "amp", "--report", "my run", "--json"])
        >>> _command(ctx)
        "overdrive demo --quick --stage amp --json - --report 'my run'"
    """
    import shlex

    parts = ["overdrive", "demo"]
    for p in ctx.command.params if ctx is not None else ():
        v = ctx.params.get(p.name) if p.name else None  # type: ignore[union-attr]
        if not isinstance(p, click.Option) or v is None or v is False or v == () or v == p.default:
            continue
        flag = max(p.opts, key=len)  # the long name
        if p.is_flag:
            parts.append(flag)
        else:
            for x in v if p.multiple else (v,):
                parts += [flag, str(x)]
    return shlex.join(parts)


def _git_commit() -> str | None:
    """The checkout's commit when overdrive runs from a git clone (for the report), else None."""
    from pathlib import Path

    from overdrive._utils.git import git_state

    return git_state(Path(__file__).resolve().parent)[0]
