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
