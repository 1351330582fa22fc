"""``overdrive exec``: load an engine and time it like trtexec (performance summary in its layout)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from overdrive.cli.common import (FiniteFloat, check_device, check_distinct, check_json_target, check_output, input_files,
                                  join_repeated, json_option, layer_info_options, trtexec_noops, write_json)


@contextlib.contextmanager
def _dump_file(export: str | None, dump: bool, name: str) -> Iterator[str | None]:
    """Where the benchmark writes what a --dump flag prints (one inference's outputs, the profile): the matching
    --export flag's file, or for the --dump flag alone a temporary one, removed after."""
    if export or not dump:
        yield export
        return
    with tempfile.TemporaryDirectory(prefix="overdrive-dump-") as d:
        yield str(Path(d) / name)


def _read_outputs(path: str | None) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text()) if path else []


def format_profile(rows: list[dict[str, Any]]) -> str:
    """trtexec's ``--dumpProfile`` block from ``--exportProfile``'s rows (the first one the run count): total and
    per-run time and share of each layer (a kernel or operator; an ONNX Runtime node), slowest first, then the total.

    Example:
        >>> print(format_profile([{"count": 10}, {"name": "conv", "timeMs": 2.0, "averageMs": 0.2, "count": 10,
        ...                                        "percentage": 100.0}]))
        [I] === Profile (10 iterations) ===
        [I]    Time(ms)     Avg.(ms)   Time(%)   Layer
        [I]        2.00       0.2000     100.0   conv
        [I]        2.00       0.2000     100.0   Total
    """
    runs = rows[0].get("count", 0) if rows else 0
    layers = rows[1:]
    lines = [f"[I] === Profile ({runs} iterations) ===", f"[I] {'Time(ms)':>11}  {'Avg.(ms)':>11}  {'Time(%)':>8}   Layer"]
    for r in layers:
        lines.append(f"[I] {r['timeMs']:>11.2f}  {r['averageMs']:>11.4f}  {r['percentage']:>8.1f}   {r['name']}")
    total = sum(r["timeMs"] for r in layers)
    lines.append(f"[I] {total:>11.2f}  {total / max(runs, 1):>11.4f}  {100.0 if layers else 0.0:>8.1f}   Total")
    return "\n".join(lines)


def format_outputs(rows: list[dict[str, Any]]) -> str:
    """trtexec's ``--dumpOutput`` block: each output's name and dimensions, then its values on one line.

    Example:
        >>> print(format_outputs([{"name": "y", "dimensions": "1x2", "values": [0.5, -1.0]}]))
        [I] Output Tensors:
        [I] y: (1x2)
        [I] 0.5 -1
    """
    lines = ["[I] Output Tensors:"]
    for r in rows:
        lines.append(f"[I] {r['name']}: ({r['dimensions']})")
        lines.append("[I] " + " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in r["values"]))
    return "\n".join(lines)


class _ExecCommand(click.Command):
    """exec's command: a trtexec build-and-run line (``--onnx=model.onnx --fp16 --shapes=...``) is two commands
    here, build then exec; such a line is answered with both, not with click's "No such option '--onnx'. Did you mean
    '--json'?"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        onnx = next((a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "model.onnx")
                     for i, a in enumerate(args) if a == "--onnx" or a.startswith("--onnx=")), None)
        if onnx is not None and not ({"-h", "--help"} & set(args)):
            from overdrive._utils.errors import UsageError

            engine = f"{Path(onnx).with_suffix('.engine').name}"
            raise UsageError(f"exec loads an engine (trtexec's --loadEngine); trtexec's --onnx line builds and runs in "
                             f"one, which is two commands here: `overdrive build --onnx {onnx} --saveEngine {engine}` "
                             f"with the line's build flags (--fp16/--int8/--best, --shapes or --minShapes/--optShapes/"
                             f"--maxShapes), then `overdrive exec --loadEngine {engine}` with its run flags (--shapes, "
                             f"--iterations, --duration, --warmUp, ...)")
        return super().parse_args(ctx, args)


@click.command("exec", cls=_ExecCommand)
@click.option("--load-engine", "--loadEngine", "load_engine", required=True, metavar="FILE", help="Engine built by `overdrive build`.")
@click.option("--shapes", multiple=True, callback=join_repeated, help="Input shapes to run (inside the engine's profile); default: the opt shapes.")
@click.option("--iterations", default=10, show_default=True, type=click.IntRange(min=1), help="Run at least this many iterations.")
@click.option("--warm-up", "--warmUp", "warm_up", default=200.0, show_default=True, type=FiniteFloat(min=0), help="Warm-up time in ms.")
@click.option("--duration", default=3.0, show_default=True, type=FiniteFloat(min=0), help="Run at least this many seconds.")
@click.option("--use-cuda-graph", "--useCudaGraph", "use_cuda_graph", is_flag=True,
              help="As trtexec's: inductor engines on CUDA replay CUDA graphs always, so this only checks that "
              "this engine does (refused on CPU and on backends that record none).")
@click.option("--no-data-transfers", "--noDataTransfers", "no_data_transfers", is_flag=True, help="Skip H2D/D2H copies.")
@click.option("--percentile", default="90,95,99", show_default=True, help="Comma-separated latency percentiles.")
@click.option("--device", default=None, help="Device to load on (default: the one it was built for).")
@click.option("--precision", default=None, help="Refuse the engine unless it was built for this precision.")
@click.option("--export-times", "--exportTimes", "export_times", default=None, metavar="FILE", help="Per-iteration times as JSON.")
@click.option("--export-profile", "--exportProfile", "export_profile", default=None, metavar="FILE", help="Per-kernel profile as JSON.")
@click.option("--export-output", "--exportOutput", "export_output", default=None, metavar="FILE",
              help="The outputs of one inference as JSON (name, dimensions, values), as trtexec's.")
@click.option("--dump-output", "--dumpOutput", "dump_output", is_flag=True,
              help="Print the outputs of one inference after the summary, as trtexec's (name, dimensions, values).")
@click.option("--dump-profile", "--dumpProfile", "dump_profile", is_flag=True,
              help="Print the per-kernel profile (timed on a separate run, as --exportProfile's) after the summary, "
                   "as trtexec's.")
@layer_info_options("before the run")
@click.option("--load-inputs", "--loadInputs", "load_inputs", default=None, metavar="NAME:FILE,...|FILE",
              help="Run on these inputs instead of random ones: name:file.bin raw files in each input's dtype at "
                   "--shapes (default the opt shapes), as trtexec's; or one .pt / .npz file (as compare --inputs).")
@click.option("--trust", is_flag=True, help="Load an engine not signed with your key whole (its native library and "
              "compile cache run): only for engines from a source you trust.")
@trtexec_noops(("--avgRuns", False, "the summary gives the median and percentiles over every timed run"),
               ("--separateProfileRun", True, "--exportProfile and --dumpProfile always profile on a separate run"),
               ("--useSpinWait", True, "the host already spins on each iteration's end (a CUDA event without blocking "
                "sync; CPU calls are synchronous)"),
               *((f, False, "overdrive exec times one inference stream (trtexec's default, 1)") for f in
                 ("--streams", "--infStreams")),
               ("--threads", True, "overdrive exec drives its one inference stream from one thread"),
               ("--profilingVerbosity", False, "--exportProfile and --dumpProfile name every kernel (or ONNX Runtime "
                "node) the run records; --dumpLayerInfo / --exportLayerInfo give every layer in detail"))
@json_option("the summary")
def command(load_engine: str, shapes: str | None, iterations: int, warm_up: float, duration: float, use_cuda_graph: bool,
            no_data_transfers: bool, percentile: str, device: str | None, precision: str | None, export_times: str | None,
            export_profile: str | None, export_output: str | None, dump_output: bool, dump_profile: bool,
            dump_layer_info: bool, export_layer_info: str | None, load_inputs: str | None,
            trust: bool, json_path: str | None) -> None:
    """Load an engine and report throughput, latency, enqueue, H2D, compute and D2H times.

    An engine is code for the machine it was built on, like a TensorRT plan: its sections can hold an
    AOTInductor library and an Inductor cache that unpickles. `overdrive build` signs engines with your key
    (OVERDRIVE_SIGNING_KEY, OVERDRIVE_SIGNING_KEY_FILE, or ~/.config/overdrive/signing.key); an engine that
    is not signed with it loads in safe mode, compiled again from its exported program with nothing from the
    file run, unless --trust is given.

    \b
    Examples:
      overdrive exec --load-engine model.engine
      overdrive exec --loadEngine rn50_fp16.engine --duration 10 --percentile 50,99 --json summary.json
      overdrive exec --loadEngine model.engine --loadInputs input:x.bin --exportOutput out.json --iterations 1
    """
    from overdrive._utils.errors import UsageError, did_you_mean
    from overdrive.engine import Engine, parse_shapes
    from overdrive.engine.config import PRECISIONS
    from overdrive.engine.benchmark import check_cuda_graph, check_load_inputs, check_percentiles, format_summary
    from overdrive.engine.benchmark import load_inputs as read_inputs

    check_json_target(json_path)
    check_device("--device", device)
    check_output("--export-times", export_times)  # before the load, which can take a compile
    check_output("--export-profile", export_profile)
    check_output("--export-output", export_output)
    check_output("--export-layer-info", export_layer_info)
    check_load_inputs(load_inputs)
    check_distinct([("--export-times", export_times), ("--export-profile", export_profile),
                    ("--export-output", export_output), ("--export-layer-info", export_layer_info),
                    ("--json", json_path)],
                   [("--load-engine", load_engine), *(("--load-inputs", f) for f in input_files(load_inputs))])
    try:
        pct = tuple(float(p) for p in percentile.split(",") if p.strip())
    except ValueError as exc:
        raise UsageError(f"--percentile {percentile!r} must be numbers separated by commas, like 90,95,99") from exc
    check_percentiles(pct)  # before the load, which can take a compile
    if precision is not None and precision not in PRECISIONS:  # named by its flag, before the load
        raise UsageError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}"
                         f"{did_you_mean(precision, PRECISIONS, list_up_to=0)}")
    engine = Engine.load(load_engine, device=device, precision=precision, trust=trust)
    if use_cuda_graph:
        check_cuda_graph(engine.device.type, engine.header["backend"])
    layers = None
    if dump_layer_info or export_layer_info:  # before the run, as trtexec gives it
        from overdrive.engine.layers import format_layer_info, layer_info

        layers = layer_info(engine)
        if export_layer_info:
            write_json(layers, export_layer_info)
    given = parse_shapes(shapes) or None
    xs = read_inputs(engine, load_inputs, given) if load_inputs else None
    with _dump_file(export_output, dump_output, "outputs.json") as out_path, \
            _dump_file(export_profile, dump_profile, "profile.json") as prof_path:
        summary = engine.benchmark(inputs=xs, shapes=given, iterations=iterations, warmup_ms=warm_up,
                                   duration_s=duration, percentiles=pct, no_data_transfers=no_data_transfers,
                                   export_times=export_times, export_profile=prof_path, export_output=out_path)
        dumped = _read_outputs(out_path) if dump_output else None
        profiled = _read_outputs(prof_path) if dump_profile else None
    summary["load_s"] = engine.load_s
    summary["load_compile"] = engine.load_compile
    if json_path is not None:
        write_json(summary, json_path)
    if json_path != "-":
        lc = engine.load_compile
        cache = (f"; Inductor graph cache: {lc['hit']} hit(s), {lc['miss']} miss(es), {lc['bypass']} bypass(es)"
                 if lc and any(lc.values()) else "")
        tr = engine.trust
        click.echo(f"[I] loaded {load_engine} ({engine.info['runtime']}) in {engine.load_s:.2f} s{cache}; "
                   f"signature: {tr['signature']}, {tr['mode']} load")
        if use_cuda_graph:
            click.echo("[I] CUDA graphs: on (inductor engines on CUDA replay one recorded graph per input shape)")
        if dump_layer_info:
            click.echo(format_layer_info(layers, engine.header["backend"]))
        click.echo(format_summary(summary))
    if dump_layer_info and json_path == "-":  # stdout carries the JSON
        click.echo(format_layer_info(layers, engine.header["backend"]), err=True)
    if dumped is not None:  # after the summary, as trtexec prints it; on stderr when stdout carries --json -
        click.echo(format_outputs(dumped), err=json_path == "-")
    if profiled is not None:
        click.echo(format_profile(profiled), err=json_path == "-")
