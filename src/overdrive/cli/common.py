"""Helpers shared by the verbs: console output and JSON writing."""

from __future__ import annotations

import click

import json
import math
import os
import sys
from pathlib import Path
from typing import Any


def json_option(what: str) -> Any:
    """The one ``--json [FILE]`` of every verb: bare ``--json`` (or ``--json -``) prints ``what`` as JSON on stdout
    instead of the tables; ``--json FILE`` writes it to FILE as well as printing the tables.

    Example:
        >>> @click.command()
        ... @json_option("the report")
        ... def cmd(json_path): click.echo(repr(json_path))
        >>> from click.testing import CliRunner
        >>> CliRunner().invoke(cmd, ["--json"]).output.strip(), CliRunner().invoke(cmd, ["--json", "r.json"]).output.strip()
        ("'-'", "'r.json'")
    """
    return click.option("--json", "json_path", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
                        help=f"Write {what} as JSON: to FILE, or to stdout instead of the tables with a bare --json.")


class FiniteFloat(click.FloatRange):
    """A float range that also refuses inf and nan (``FloatRange(min=0)`` took ``--duration inf``: a run that
    never ended)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        out = super().convert(value, param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return out


class Tolerance(click.ParamType):
    """``--atol`` / ``--rtol``: a finite float >= 0. inf is refused like NaN and negatives: an infinite atol passed
    even an output of inf against a finite reference (inf <= inf), and an infinite rtol failed where the reference is
    0 (inf * 0 is NaN), so it meant neither "check nothing" nor anything else one could state.

    Example:
        >>> Tolerance().convert("1e-3", None, None)
        0.001
    """

    name = "tolerance"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            out = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number; give a tolerance >= 0 such as 1e-3", param, ctx)
        if not (math.isfinite(out) and out >= 0):
            self.fail(f"{value!r}: expected a finite tolerance >= 0 such as 1e-3 (a large one, e.g. 1e9, passes any "
                      "difference below it)", param, ctx)
        return out


def join_repeated(ctx: Any, param: Any, value: tuple[str, ...]) -> str | None:
    """The callback of the shape flags (``multiple=True``): ``--shapes x:1x3 --shapes y:2x4`` reads as
    ``--shapes x:1x3,y:2x4`` (the last one alone was kept, silently dropping the first input's shape).

    Example:
        >>> join_repeated(None, None, ("x:1x3", "y:2x4")), join_repeated(None, None, ())
        ('x:1x3,y:2x4', None)
    """
    return ",".join(value) if value else None


PIPED_WIDTH = 200  # columns of a table printed to a pipe or file (rich's 80 cut the demo's tables mid-column)


def layer_info_options(when: str) -> Any:
    """trtexec's ``--dumpLayerInfo`` and ``--exportLayerInfo=FILE``, as build and exec both take them (``when``: where
    the dump is printed).

    Example:
        >>> @click.command()
        ... @layer_info_options("after the build")
        ... def cmd(dump_layer_info, export_layer_info): click.echo(f"{dump_layer_info} {export_layer_info}")
        >>> from click.testing import CliRunner
        >>> CliRunner().invoke(cmd, ["--dumpLayerInfo", "--exportLayerInfo=l.json"]).output.strip()
        'True l.json'
    """
    dump = click.option("--dump-layer-info", "--dumpLayerInfo", "dump_layer_info", is_flag=True,
                        help=f"Print the engine's layers {when}, as trtexec's: each layer's type, inputs and outputs, "
                             "where an int8/fp8 build placed it, then the bindings and the build's fusions.")
    export = click.option("--export-layer-info", "--exportLayerInfo", "export_layer_info", default=None,
                          metavar="FILE", help="Write the engine's layers as JSON, as trtexec's (Layers, Bindings; "
                                               "Fusions where the build made any).")
    return lambda f: dump(export(f))


def trtexec_noops(*specs: tuple[str, bool, str]) -> Any:
    """Options a pasted trtexec line carries that mean nothing here, each ``(flag, is_flag, why)``: accepted (so
    the line runs), with one ``[I] <flag> has no effect here: <why>`` line on stderr when given.

    Example:
        >>> @click.command()
        ... @trtexec_noops(("--workspace", False, "no builder memory limit here"))
        ... def cmd() -> None:
        ...     pass
        >>> from click.testing import CliRunner
        >>> CliRunner().invoke(cmd, ["--workspace=4096"]).output.strip()
        '[I] --workspace has no effect here: no builder memory limit here'
    """
    def decorate(f: Any) -> Any:
        for flag, is_flag, why in reversed(specs):
            def note(ctx: Any, param: Any, value: Any, flag: str = flag, why: str = why) -> None:
                if value not in (None, False):
                    click.echo(f"[I] {flag} has no effect here: {why}", err=True)

            f = click.option(flag, is_flag=is_flag, default=False if is_flag else None, expose_value=False,
                             callback=note, metavar=None if is_flag else "VALUE",
                             help=f"trtexec's; accepted, no effect here: {why}.")(f)
        return f
    return decorate


def console() -> Any:
    """stdout's rich console: the terminal's width on a TTY; piped or redirected, ``$COLUMNS`` when set,
    else :data:`PIPED_WIDTH`, so tables written to a file or ``| less`` keep their columns whole."""
    import os
    import sys

    from rich.console import Console

    tty = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
    width = None if tty or os.environ.get("COLUMNS") else PIPED_WIDTH
    return Console(highlight=False, width=width, emoji=False)


def progress_option() -> Any:
    """The ``--no-progress`` of the verbs with long steps (a spinner with the elapsed time on stderr, drawn
    only when stderr is a terminal and not with a bare ``--json``)."""
    return click.option("--no-progress", is_flag=True, help="No progress display (none is drawn when stderr is "
                        "not a terminal either).")


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


VERBOSE = False  # set by overdrive.cli.main from --verbose: commands that catch errors print tracebacks too


def write_json(data: Any, target: str | None) -> None:
    """Write ``data`` as JSON to ``target`` ('-' or None: stdout)."""
    text = json.dumps(_clean(data), indent=2, default=str)
    if target in (None, "-"):
        sys.stdout.write(text + "\n")
    else:
        from overdrive._utils.files import atomic_write

        atomic_write(target, text + "\n")


def _takes_files(folder: Path) -> bool:
    """Whether a file can be made in ``folder``: os.access says yes to root everywhere, also on a read-only mount or
    in /proc, where the write would fail after the work. An unnamed temporary file, gone when closed."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_output(flag: str, target: str | None, folder: bool = False) -> None:
    """Refuse an output path before any work, not after it: the folder it goes in must exist and be writable,
    so nothing is created outside the path named (``/nonexistent/x.onnx`` is refused, never made). A file
    output must not be an existing folder; a ``folder=True`` output (``demo --report DIR``) must not be a file.

    Example:
        >>> check_output("--export", "/nonexistent/x.onnx")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --export /nonexistent/x.onnx: parent folder does not exist ('/nonexistent'); create it first or give a path in an existing folder
    """
    if target is None:
        return
    import os

    from overdrive._utils.errors import UsageError

    path = Path(target)
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {target}: parent folder does not exist ({str(parent)!r}); create it first or give "
                         "a path in an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK) or not _takes_files(parent):
        raise UsageError(f"{flag} {target}: folder {str(parent)!r} is not writable; give a path in a folder you "
                         "can write to")
    if folder:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{flag} {target}: exists and is not a folder; give a folder path")
    elif path.is_dir():
        raise UsageError(f"{flag} {target}: is a directory; give a file path such as {str(path / 'out')!r}")


def spec_file(spec: str | None) -> str | None:
    """The file a ``--model`` spec reads: ``path/to/file.py:factory``'s file, or the source file of a dotted
    ``pkg.module:factory`` (found as the model loader finds it, the current folder first), so that no output path
    overwrites a model's own code; None when there is no spec or no such file.

    Example:
        >>> spec_file("models/net.py:build"), spec_file("no_such_pkg_here.models:build")
        ('models/net.py', None)
    """
    if not spec or ":" not in spec:
        return None
    where = spec.rsplit(":", 1)[0]
    if where.endswith(".py"):
        return where
    import importlib.util

    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError, AttributeError):
        return None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    origin = getattr(found, "origin", None)
    return origin if origin and origin.endswith(".py") and Path(origin).is_file() else None


def input_files(spec: str | None) -> list[str]:
    """The files of a ``--load-inputs`` value: one ``.pt`` / ``.npz`` file, or ``name:file,...`` raw files.

    Example:
        >>> input_files("x:x.bin,mask:m.bin"), input_files("batch.pt")
        (['x.bin', 'm.bin'], ['batch.pt'])
    """
    if not spec:
        return []
    if Path(spec).suffix in (".pt", ".npz") or ":" not in spec:
        return [spec]
    return [e.split(":", 1)[1].strip().strip("'\"") for e in spec.split(",") if ":" in e]


def check_distinct(outputs: list[tuple[str, str | None]], inputs: list[tuple[str, str | None]] = ()) -> None:
    """Refuse, before any work, an output path that is one of the command's inputs (``--save-engine model.onnx``
    beside ``--onnx model.onnx`` would replace the model) or another of its outputs (the engine written over the
    timing cache). Paths compare after resolving links and ``..``, and as the same file where both exist (a hard
    link). ``-`` (stdout) and unset paths are skipped.

    Example:
        >>> check_distinct([("--save-engine", "m.onnx")], [("--onnx", "./m.onnx")])
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --save-engine m.onnx is the --onnx input: writing it would replace that file; give the output another path
    """
    import os

    from overdrive._utils.errors import UsageError

    def same(a: str, b: str) -> bool:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        try:
            return os.path.samefile(a, b)
        except OSError:  # one of them does not exist (yet)
            return False

    given = [(f, t) for f, t in outputs if t and t != "-"]
    for i, (flag, target) in enumerate(given):
        for iflag, src in inputs:
            if src and src != "-" and same(target, src):
                raise UsageError(f"{flag} {target} is the {iflag} input: writing it would replace that file; give "
                                 "the output another path")
        for oflag, other in given[:i]:
            if same(target, other):
                raise UsageError(f"{flag} {target} is also the {oflag} output: one would overwrite the other; give "
                                 "each its own path")


def check_device(flag: str, value: str | None) -> None:
    """Refuse a device name that is none (``--device gpu0``) before any work, naming the flag; whether the
    device is usable here is the library's check (its message says what to use instead).

    Example:
        >>> check_device("--device", "gpu0")
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --device gpu0: not a device; use auto, cpu, cuda or cuda:N
    """
    if value is None or value == "auto":
        return
    import torch

    from overdrive._utils.errors import UsageError

    try:
        ok = torch.device(value).type in ("cpu", "cuda")
    except (RuntimeError, TypeError):
        ok = False
    if not ok:
        raise UsageError(f"{flag} {value}: not a device; use auto, cpu, cuda or cuda:N")


def check_json_target(target: str | None) -> None:
    """Refuse a ``--json FILE`` whose folder does not exist before the work, not after it ('-' is stdout)."""
    if target != "-":
        check_output("--json", target)


def _first_global(data: bytes) -> str | None:
    """The first class a pickle names (``module.Class``), read from its opcodes without unpickling anything."""
    import pickletools

    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":  # protocol <= 3 (torch.save's default): "module Class"
                return str(arg).replace(" ", ".")
            if isinstance(arg, str):
                strings.append(arg)
            if op.name == "STACK_GLOBAL" and len(strings) >= 2:  # protocol 4+: the two strings pushed before it
                return f"{strings[-2]}.{strings[-1]}"
    except Exception:  # noqa: BLE001 - a truncated or foreign pickle: say nothing about it
        return None
    return None


def check_torchscript(flag: str, path: str | None) -> None:
    """Refuse, before any work, a ``--torchscript`` file that is a plain ``torch.save`` pickle (a whole
    ``nn.Module`` or a state_dict) rather than a ``torch.jit.save`` archive: ``torch.jit.load`` only says
    "PytorchStreamReader failed locating file constants.pkl". Nothing is unpickled to tell them apart.

    Example:
        >>> check_torchscript("--torchscript", None)  # nothing given: nothing to check
    """
    import zipfile

    if not path or not Path(path).is_file() or not zipfile.is_zipfile(path):
        return  # a missing or non-zip file: the loader's own error says what it is
    from overdrive._utils.errors import UsageError

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
            return  # TorchScript
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            return
        cls = _first_global(z.read(pkl))
    save = "torch.jit.save(torch.jit.trace(model, example), path)"
    if cls in (None, "collections.OrderedDict", "builtins.dict") or (cls or "").startswith("torch._utils."):
        raise UsageError(f"{flag} {path} holds weights (a torch.save state_dict), not TorchScript; build from the "
                         f"model's code with --model file.py:factory --checkpoint {path}, or save TorchScript with {save}")
    raise UsageError(f"{flag} {path} is a pickled Python module ({cls}, written by torch.save(model)), not "
                     f"TorchScript; build from its code with --model file.py:factory (a function returning the model; "
                     f"weights via --checkpoint, saved with torch.save(model.state_dict(), path)), or save TorchScript "
                     f"with {save}")


def check_calib_cache(flag: str, path: str | None) -> None:
    """Refuse, before any work, a TensorRT calibration cache given as calibration data: trtexec's ``--calib`` reads
    one (a text file opening ``TRT-8601-EntropyCalibration2``, then ``tensor: hex scale`` lines), so a pasted
    ``--int8 --calib=model.cache`` gave it here, and the calibration loader only said it was no tensor file.

    Example:
        >>> check_calib_cache("--calib", None)  # nothing given: nothing to check
    """
    import re

    if not path or not Path(path).is_file():
        return
    with open(path, "rb") as f:
        first = f.read(64).split(b"\n", 1)[0].strip()
    m = re.fullmatch(rb"TRT-\d+-(\w*Calibration\w*)", first)
    if m is None:
        return
    from overdrive._utils.errors import UsageError

    raise UsageError(f"{flag} {path} is a TensorRT calibration cache ({m.group(1).decode()} scales that TensorRT wrote, "
                     "as trtexec's --calib reads), not calibration data: overdrive calibrates from the model's inputs; "
                     "give them as a torch.save of a tensor (N, ...) or a list of batches, an .npy / .npz file, or a "
                     "folder of images (see --help)")


def layer_info(engine: Any) -> dict[str, Any]:
    """trtexec's ``--exportLayerInfo`` JSON for an engine: :func:`overdrive.engine.layers.layer_info`."""
    from overdrive.engine.layers import layer_info as info

    return info(engine)


def format_layer_info(info: dict[str, Any], backend: str) -> str:
    """trtexec's ``--dumpLayerInfo`` block: :func:`overdrive.engine.layers.format_layer_info`."""
    from overdrive.engine.layers import format_layer_info as fmt

    return fmt(info, backend)
