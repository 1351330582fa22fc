"""One reader of model specs for every verb: ``"pkg.module:factory"`` or ``"path/to/file.py:factory"``.

The factory is called with no arguments and must return an ``nn.Module``. Importing a module or a
file runs its code, as ``python file.py`` would: give only specs you trust. A dotted module is looked up
with the current folder on the path too, as ``python -m`` does (``mypkg.models:build`` from the folder
holding ``mypkg/``, with no ``PYTHONPATH=.``).

Example:
    >>> type(load_factory("torch.nn:Identity")).__name__
    'Identity'
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from overdrive._utils.errors import UsageError


@contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current folder first on ``sys.path`` for the import and the factory call (which may import
    lazily), then ``sys.path`` as it was."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def load_factory(spec: str, flag: str = "model spec") -> nn.Module:
    """Import ``spec``'s module (a dotted path, or a ``.py`` file), call its factory, check the result.
    ``flag`` names the spec in errors: the CLI option the user typed (``--model``), else "model spec"."""
    with _cwd_on_path():
        return _load_factory(spec, flag)


def _load_factory(spec: str, flag: str) -> nn.Module:
    if ":" not in spec:
        raise UsageError(f"{flag} {spec!r} must be 'package.module:factory' or 'path/to/file.py:factory'")
    where, attr = spec.rsplit(":", 1)
    if not attr:
        raise UsageError(f"{flag} {spec!r} names no factory after ':'; e.g. 'model.py:build'")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UsageError(f"{flag} file {where!r} does not exist; give the path of a .py file")
            name = f"_overdrive_model_{abs(hash(str(path.resolve())))}"
            loader = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
            sys.modules[name] = mod  # dataclasses and pickling look the module up by name
            loader.loader.exec_module(mod)  # type: ignore[union-attr]
        else:
            mod = importlib.import_module(where)
    except ImportError as exc:
        raise UsageError(f"{flag} {spec!r}: cannot import {where!r} ({exc}); check the module path") from exc
    factory = getattr(mod, attr, None)
    if factory is None or not callable(factory):
        raise UsageError(f"{flag} {spec!r}: {where!r} has no callable {attr!r}")
    try:
        model = factory if isinstance(factory, nn.Module) else factory()
    except TypeError as exc:
        raise UsageError(f"{flag} {spec!r}: calling {attr}() failed ({exc}); the factory must build the model "
                         "with no arguments (wrap it: def build(): return MyNet(width=64))") from exc
    except Exception as exc:  # the factory's own error: say whose, the traceback comes with --verbose
        raise UsageError(f"{flag} {spec!r}: {attr}() raised {type(exc).__name__}: {exc} (--verbose shows where)") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(f"{flag} {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model
