"""One reader of model specs for every verb: ``"pkg.module:factory"`` or ``"path/to/file.py:factory"``.

The factory is called with no arguments and must return an ``nn.Module``, or with the literal arguments the spec
spells as a Python call, as ``timm.create_model("resnet50", num_classes=10)`` or a Hydra override takes them:
``"file.py:make_model(num_classes=10, widths=[16, 32])"``. The arguments are read with ``ast.literal_eval``
(numbers, strings, bools, None, lists, tuples, dicts): never evaluated as code. Importing a module or a
file runs its code, as ``python file.py`` would: give only specs you trust. A dotted module is looked up
with the current folder on the path too, as ``python -m`` does (``mypkg.models:build`` from the folder
holding ``mypkg/``, with no ``PYTHONPATH=.``).

Example:
    >>> type(load_factory("torch.nn:Identity")).__name__
    'Identity'
    >>> load_factory("torch.nn:Linear(4, out_features=2, bias=False)").bias is None
    True
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from overdrive._utils.errors import UsageError, close_names, did_you_mean


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


CALL_FORM = "'file.py:make_model(num_classes=10, pretrained=False)' (literal values only: numbers, strings, lists, dicts)"


def split_call(spec: str, flag: str = "model spec") -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """``"where:factory(1, k=2)"`` -> ``("where:factory", (1,), {"k": 2})``; a spec with no call comes back with no
    arguments. The arguments are literals read by ``ast.literal_eval``, never evaluated.

    Example:
        >>> split_call("models.py:make_model(num_classes=10, widths=[16, 32])")
        ('models.py:make_model', (), {'num_classes': 10, 'widths': [16, 32]})
    """
    spec = spec.strip()
    paren = spec.find("(")
    if paren < 0:
        if spec.endswith(")"):
            raise UsageError(f"{flag} {spec!r} has ')' but no '('; write the arguments as {CALL_FORM}")
        return spec, (), {}
    head, call = spec[:paren].rstrip(), spec[paren:]
    if ":" not in head or not head.rsplit(":", 1)[1]:
        raise UsageError(f"{flag} {spec!r}: arguments go after the factory's name, e.g. {CALL_FORM}")
    name = head.rsplit(":", 1)[1]
    try:
        tree = ast.parse(f"_f{call}", mode="eval").body
    except SyntaxError as exc:
        raise UsageError(f"{flag} {spec!r}: the arguments {call!r} are not valid call syntax ({exc.msg}); write them "
                         f"as {CALL_FORM}") from None
    if not isinstance(tree, ast.Call) or not isinstance(tree.func, ast.Name) or tree.func.id != "_f":
        raise UsageError(f"{flag} {spec!r}: expected one call after {name!r}, e.g. {CALL_FORM}")

    def literal(node: ast.AST, what: str) -> Any:
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            src = ast.get_source_segment(f"_f{call}", node) or "?"
            raise UsageError(f"{flag} {spec!r}: {what} {src!r} is not a literal (only numbers, strings, bools, None, "
                             "lists, tuples and dicts are read; code is never run); quote strings, e.g. act='relu'") from None
    args = []
    for i, node in enumerate(tree.args):
        if isinstance(node, ast.Starred):
            raise UsageError(f"{flag} {spec!r}: *args is not supported; spell each argument, e.g. {CALL_FORM}")
        args.append(literal(node, f"positional argument {i}"))
    kwargs: dict[str, Any] = {}
    for kw in tree.keywords:
        if kw.arg is None:
            raise UsageError(f"{flag} {spec!r}: **kwargs is not supported; spell each keyword, e.g. {CALL_FORM}")
        kwargs[kw.arg] = literal(kw.value, f"argument {kw.arg}")
    return head, tuple(args), kwargs


def _load_factory(spec: str, flag: str) -> nn.Module:
    full = spec
    spec, args, kwargs = split_call(spec, flag)
    if ":" not in spec:
        raise UsageError(f"{flag} {spec!r} must be 'package.module:factory' or 'path/to/file.py:factory'")
    where, attr = spec.rsplit(":", 1)
    if not attr:
        raise UsageError(f"{flag} {spec!r} names no factory after ':'; e.g. 'model.py:build'")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UsageError(f"{flag} file {where!r} does not exist; give the path of a .py file{_near_files(path)}")
            name = f"_overdrive_model_{abs(hash(str(path.resolve())))}"
            loader = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
            sys.modules[name] = mod  # dataclasses and pickling look the module up by name
            loader.loader.exec_module(mod)  # type: ignore[union-attr]
        else:
            mod = importlib.import_module(where)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if isinstance(exc, ModuleNotFoundError) and missing and _is_part_of(missing, where):  # the path is wrong
            top = "." not in missing  # a package that may not be installed
            raise UsageError(f"{flag} {spec!r}: cannot import {where!r} ({exc}); check the module path"
                             f"{' (or install the package)' if top else ''}{_near_modules(where, missing)}") from exc
        if isinstance(exc, ModuleNotFoundError) and missing:  # the module's code imports a package not installed
            raise UsageError(f"{flag} {spec!r}: {where!r} imports {missing!r}, which this Python ({sys.executable}) "
                             "does not have; install the package that provides it, or run overdrive from the "
                             "environment that has it") from exc
        raise UsageError(f"{flag} {spec!r}: importing {where!r} failed ({exc}); fix that import in its code "
                         "(--verbose shows where)") from exc
    factory = getattr(mod, attr, None)
    if factory is None:
        raise UsageError(f"{flag} {spec!r}: {where!r} has no {attr!r}{_near_names(mod, attr, where)}")
    if not callable(factory):
        raise UsageError(f"{flag} {spec!r}: {where}'s {attr!r} is a {type(factory).__name__}, not callable; name a "
                         f"function or class that builds the model{_near_names(mod, attr, where)}")
    if isinstance(factory, nn.Module) and (args or kwargs):
        raise UsageError(f"{flag} {full!r}: {attr!r} is a module instance, not a factory; it takes no arguments "
                         f"(give '{spec}' alone, or a function that builds the model)")
    shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    try:
        model = factory if isinstance(factory, nn.Module) else factory(*args, **kwargs)
    except TypeError as exc:
        if args or kwargs:
            raise UsageError(f"{flag} {full!r}: calling {attr}({shown}) failed ({exc}); pass the arguments its "
                             f"signature takes, e.g. {CALL_FORM}") from exc
        raise UsageError(f"{flag} {spec!r}: calling {attr}() failed ({exc}); the factory must build the model "
                         f"with no arguments, or give them in the spec: {CALL_FORM}") from exc
    except Exception as exc:  # the factory's own error: say whose, the traceback comes with --verbose
        raise UsageError(f"{flag} {full!r}: {attr}({shown}) raised {type(exc).__name__}: {exc} (--verbose shows where)") from exc
    if not isinstance(model, nn.Module):
        raise UsageError(f"{flag} {full!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _is_part_of(missing: str, where: str) -> bool:
    """Whether the module an ImportError says is missing is ``where`` itself or a package above it (the spec's
    path is wrong), not something ``where``'s code imports (a dependency to install)."""
    if where.endswith(".py"):
        return False
    return missing == where or where.startswith(missing + ".")


def _near_names(mod: Any, attr: str, where: str) -> str:
    """The names of ``mod`` that ``attr`` may have meant, or the callables it defines when they are few. Read from
    ``dir`` and the module's own dict: no attribute is fetched, so a lazy package imports nothing more."""
    public = [n for n in dir(mod) if not n.startswith("_") and n != attr]
    own = [n for n, v in vars(mod).items() if not n.startswith("_") and callable(v)
           and (getattr(v, "__module__", None) == mod.__name__ or isinstance(v, nn.Module))]
    return did_you_mean(attr, public, list_up_to=0) or did_you_mean(attr, own, what=f"callables {where!r} defines")


def _near_files(path: Path) -> str:
    """The .py files beside a missing one that its name may have meant."""
    folder = path.parent
    if not folder.is_dir():
        return f" (no folder {str(folder)!r} here either)"
    return did_you_mean(path.name, [f.name for f in folder.glob("*.py")], list_up_to=0)


def _near_modules(where: str, missing: str | None) -> str:
    """The modules a misspelled dotted path may have meant: the part that failed to import (``missing``, the
    ImportError's name) against the modules beside it (a package's submodules; for a top-level name, those on the
    path, the current folder's first), the rest of the path kept.

    Example:
        >>> _near_modules("torch.nn.modules.liner", "torch.nn.modules.liner")
        "; did you mean 'torch.nn.modules.linear'?"
    """
    import pkgutil

    bad = missing if missing and _is_part_of(missing, where) else where
    parent, _, last = bad.rpartition(".")
    try:
        found = (pkgutil.iter_modules(importlib.import_module(parent).__path__) if parent
                 else pkgutil.iter_modules([os.getcwd(), *sys.path]))
        close = close_names(last, [m.name for m in found])
    except (ImportError, AttributeError):  # the parent is a module, not a package
        return ""
    rest = where[len(bad):]
    return f"; did you mean {' or '.join(repr(f'{parent}.{m}{rest}' if parent else f'{m}{rest}') for m in close)}?" if close else ""
