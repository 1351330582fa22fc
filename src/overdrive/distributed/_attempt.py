"""The rank entry point of a restarting ``overdrive launch`` on one node: runs the user's script (or ``-m`` module)
as ``__main__``, with torchrun's ``TORCHELASTIC_RESTART_COUNT`` / ``TORCHELASTIC_MAX_RESTARTS`` set to overdrive
launch's attempt number and restart budget.

Each attempt is a fresh torchrun (a new port and a new store), so a script that joins with a plain
``dist.init_process_group()`` meets no addresses of the dead attempt; torchrun would report 0 restarts to every
fresh attempt, so its variables are set here before the script runs.

Example:
    >>> # python -m torch.distributed.run --standalone ... -m overdrive.distributed._attempt train.py --lr 0.1
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    """``[-m] target args...``: run ``target`` (a script path, or a module with ``-m``) with ``args``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m overdrive.distributed._attempt [-m] SCRIPT [ARGS...]")
    target, args = argv[0], argv[1:]
    for ours, torchrun in (("OVERDRIVE_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"),
                           ("OVERDRIVE_MAX_RESTARTS", "TORCHELASTIC_MAX_RESTARTS")):
        if ours in os.environ:
            os.environ[torchrun] = os.environ[ours]
    sys.argv = [target, *args]
    if module:  # as `python -m target`: the current folder first on the path (it is: this ran with -m)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:  # as `python target`: the script's folder first on the path
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
