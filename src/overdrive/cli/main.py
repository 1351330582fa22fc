"""Entry point: ``overdrive <verb>``. Verbs are the modules of this package that define ``command``.

Errors become one line on stderr and an exit code: 2 for bad arguments or input, 1 for failures.
``--verbose`` (anywhere on the line) shows the traceback too. Warnings print as one line,
``warning: <message>``, unless ``--verbose`` (then Python's own format, with the source file and line).
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import re
import sys
import warnings
from typing import Any

import click

import overdrive
from overdrive._utils.errors import OverdriveError, UsageError

_NOT_VERBS = {"main", "common"}
# torch loggers that print a traceback for what the CLI reports as one line: fake_tensor logs ~30 lines when
# torch.export meets a wrong --shapes (the error that follows names the mismatch); --verbose keeps them
# (torch.export._trace logs "always_classified is unsupported" lines for the same failure); the ONNX exporter's
# registry logs a line per torchvision op when torchvision is absent, which nothing here needs
_NOISY_LOGGERS = ("torch._subclasses.fake_tensor", "torch.export._trace", "torch.onnx._internal.exporter._registration",
                  "torch.compiler._cache")  # a --timing-cache that is no cache: its traceback before our one line
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# click >= 8.2 raises this for a group given no verb; older click prints the help itself (a class no error matches)
_NO_ARGS: type[Exception] = getattr(click.exceptions, "NoArgsIsHelpError", type("_NeverRaised", (Exception,), {}))


class _Verbs(click.Group):
    """Discovers verb modules lazily, so `overdrive env` does not import every technique."""

    def _names(self) -> list[str]:
        pkg = importlib.import_module("overdrive.cli")
        return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_VERBS and not m.name.startswith("_"))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [n.replace("_", "-") for n in self._names()]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        mod = cmd_name.replace("-", "_")
        if mod not in self._names():
            return None
        return importlib.import_module(f"overdrive.cli.{mod}").command

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        # click suggests close names from the commands it holds, and this group holds none until asked (lazy):
        # `overdrive buld` would get no 'build' to try
        name = args[0] if args else ""
        if (args and not ctx.resilient_parsing and not name.startswith("-")
                and self.get_command(ctx, name) is None):
            from overdrive._utils.errors import close_names

            close = close_names(name, self.list_commands(ctx))
            hint = (f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else
                    f" The commands are: {', '.join(self.list_commands(ctx))}.")
            raise click.UsageError(f"No such command {name!r}.{hint}", ctx)
        return super().resolve_command(ctx, args)


@click.group(cls=_Verbs, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(overdrive.__version__, "--version", prog_name="overdrive")
@click.option("--verbose", is_flag=True, help="Show tracebacks on errors.")
def cli(verbose: bool) -> None:
    """overdrive: make PyTorch train faster and serve faster.

    \b
    Examples:
      overdrive env                 # versions, GPUs and usable backends
      overdrive demo                # the whole path on the digits dataset
      overdrive demo --device cuda --json results.json
    """


def _error(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True, emoji=False).print(f"[bold red]error:[/] {msg}", markup=True)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    own = _own_args(args)
    verbose = "--verbose" in args[:own]
    if verbose:  # accepted anywhere among overdrive's own arguments, not only before the verb
        args = [a for a in args[:own] if a != "--verbose"] + args[own:]
    from overdrive.cli import common

    common.VERBOSE = verbose
    code = 0
    # a filter, not a level: torch's logging set-up resets these loggers' levels when torch._dynamo loads
    quiet = [] if verbose else [logging.getLogger(n) for n in _NOISY_LOGGERS]
    with warnings.catch_warnings():  # restores showwarning when the verb returns (tests call main() in-process)
        if not verbose:
            warnings.showwarning = _show_warning
        for logger in quiet:
            logger.addFilter(_drop)
        try:
            code = _run(args, verbose)
        finally:
            for logger in quiet:
                logger.removeFilter(_drop)
    if argv is None:
        sys.exit(code)
    return code


def _drop(record: logging.LogRecord) -> bool:
    return False


def _library_internal(category: type[Warning], filename: str) -> bool:
    """A deprecation that one installed library raises about its own or another library's code (torch's
    compiler deep-copying its deprecated ``LeafSpec`` warns from ``copyreg.py`` on every CPU engine build): not
    overdrive's and not the user's code, so nothing the CLI user can change. Python hides DeprecationWarning
    outside ``__main__`` for the same reason; FutureWarning is dropped only when raised from a library file."""
    import sysconfig

    if not issubclass(category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning)):
        return False
    path = os.path.realpath(filename)
    if path.startswith(os.path.dirname(os.path.realpath(overdrive.__file__)) + os.sep):
        return False  # overdrive's own call of a deprecated API: ours to fix, so shown
    libs = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
    return any(path.startswith(lib + os.sep) for lib in libs)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """A warning as one line, ``warning: <message>``, without the source path and line that Python
    prints (which name overdrive's or torch's files, not anything the user typed); --verbose shows them.
    Deprecations inside installed libraries are not shown (:func:`_library_internal`), unless --verbose."""
    if _library_internal(category, filename):
        return
    from rich.console import Console

    text = " ".join(str(message).split())
    Console(stderr=True, highlight=False, soft_wrap=True, emoji=False).print(f"[yellow]warning:[/] {_escape(text)}", markup=True)


def _run(args: list[str], verbose: bool) -> int:
    code = 0
    try:
        rv: Any = cli.main(args=args, prog_name="overdrive", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.exceptions.Abort as exc:  # click turns Ctrl-C (KeyboardInterrupt) into Abort: exit as Ctrl-C does
        interrupted = isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt)
        _error("interrupted" if interrupted else "aborted")
        code = 130 if interrupted else 1
    except _NO_ARGS as exc:  # `overdrive` or `overdrive data` alone: the help as help, not one mashed error line
        click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message(), err=True)
        code = 2
    except click.ClickException as exc:  # bad arguments: unknown option, bad value, missing argument
        _error(_escape(exc.format_message()) + "  (see --help)")
        code = exc.exit_code if exc.exit_code else 2
        if verbose:
            raise
    except UsageError as exc:
        _error(_escape(_with_flags(str(exc), _flags_of(args))))
        code = 2
        if verbose:
            raise
    except OverdriveError as exc:
        _error(_escape(str(exc)))
        code = 1
        if verbose:
            raise
    except KeyboardInterrupt:
        _error("interrupted")
        code = 130
    except Exception as exc:  # an unexpected failure: one line unless --verbose
        if verbose:
            raise
        _error(_escape(f"{type(exc).__name__}: {_first_lines(str(exc))}") + "  (run with --verbose for the traceback)")
        code = 1
    return code


def _first_lines(msg: str, limit: int = 400) -> str:
    r"""An exception's message as one line: its lines up to a C++ stack (torch's ``Exception raised from ...`` and
    ``frame #0 ...``, 20 lines after an Inductor kernel's index check) joined, cut at ``limit`` characters.

    Example:
        >>> _first_lines("index out of bounds: 0 <= tmp12 < 50\nException raised from run at x.cpp:7\nframe #0: f")
        'index out of bounds: 0 <= tmp12 < 50'
    """
    kept = []
    for line in msg.splitlines():
        if line.lstrip().startswith(("Exception raised from", "frame #")):
            break
        if line.strip():
            kept.append(line.strip())
    one = " ".join(kept)
    return one if len(one) <= limit else one[: limit - 3] + "..."


def _flags_of(args: list[str]) -> dict[str, str]:
    """The Python parameter names of the verb on this command line -> the flags the user types
    (``batch_size`` -> ``--batch-size``); {} when no verb is named."""
    cmd: click.Command = cli
    i, end = 0, _own_args(args)
    while isinstance(cmd, click.Group) and i < end:
        a = args[i]
        i += 1
        if a.startswith("-"):
            continue
        sub = cmd.get_command(click.Context(cmd), a)
        if sub is None:
            return {}
        cmd = sub
    if isinstance(cmd, click.Group):
        return {}
    return {p.name: max(p.opts, key=len) for p in cmd.params if isinstance(p, click.Option) and p.name}


def _with_flags(message: str, flags: dict[str, str]) -> str:
    """A library message's ``name=value`` (the Python argument) as the flag the user typed, ``--flag value``:
    ``batch_size=-1 must be >= 1`` from ``--batch-size -1`` reads ``--batch-size -1 must be >= 1``.

    Example:
        >>> _with_flags("node_rank=2 must be in [0, nnodes=1)", {"node_rank": "--node-rank", "nnodes": "--nnodes"})
        '--node-rank 2 must be in [0, --nnodes 1)'
    """
    if not flags:
        return message
    names = "|".join(re.escape(n) for n in sorted(flags, key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({names})=", lambda m: flags[m.group(1)] + " ", message)


def _own_args(args: list[str]) -> int:
    """How many leading arguments are overdrive's: everything before ``--``, and for ``launch``
    everything before the training script (whose own flags, ``--verbose`` too, pass through)."""
    end = args.index("--") if "--" in args else len(args)
    if "launch" in args[:end]:
        from overdrive.cli.launch import command as launch

        takes_value = {o for p in launch.params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
        i = args.index("launch") + 1
        while i < end:  # the script is the first argument that is neither an option nor an option's value
            a = args[i]
            if a in takes_value:
                i += 2
            elif a.startswith("-"):
                i += 1  # a flag, or --opt=value
            else:
                return i
    return end


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(" ".join(_ANSI.sub("", text).split()))  # torch's messages can carry terminal colour codes


if __name__ == "__main__":  # python -m overdrive.cli.main
    main()
