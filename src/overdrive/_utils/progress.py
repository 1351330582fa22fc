"""A spinner with the elapsed time for a long step that has no steps to count (an ONNX export, a torchrun
job, the bandwidth test), on stderr so that stdout (tables, ``--json``) stays clean.

Shown only where someone watches: ``enabled`` (the verbs' ``--no-progress`` turns it off) and stderr a
terminal; piped or redirected it prints nothing, as the training loop's progress bar does.

Example:
    >>> with status("exporting ONNX", enabled=False):
    ...     pass
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def shown(enabled: bool = True) -> bool:
    """Whether a progress display would be drawn: asked for, and stderr is a terminal."""
    return enabled and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


@contextlib.contextmanager
def status(description: str, enabled: bool = True) -> Iterator[None]:
    """Show ``description``, a spinner and the elapsed time while the block runs; removed when it ends."""
    if not shown(enabled):
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        bar.add_task(description, total=None)
        yield
