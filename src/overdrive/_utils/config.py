"""The config base: one dict/JSON round trip and one ``replace`` for every technique's frozen config.

A technique's config is a ``@dataclass(frozen=True)`` that also derives from :class:`ConfigBase`. The base
reads the field types (``typing.get_type_hints``) to turn JSON back into what the fields hold: lists into
tuples, dtype names into ``torch.dtype``, dicts into nested configs. Validation stays in each class's
``__post_init__``, which runs on every construction, ``from_dict`` and ``replace`` included.

Example:
    >>> import dataclasses, torch
    >>> @dataclasses.dataclass(frozen=True)
    ... class Inner(ConfigBase):
    ...     bits: int = 8
    >>> @dataclasses.dataclass(frozen=True)
    ... class Outer(ConfigBase):
    ...     inner: Inner = Inner()
    ...     dtype: torch.dtype = torch.float16
    ...     names: tuple[str, ...] = ("a",)
    >>> Outer().to_dict()
    {'inner': {'bits': 8}, 'dtype': 'float16', 'names': ['a']}
    >>> Outer.from_json(Outer().to_json()) == Outer()
    True
    >>> Outer().replace(colour=1)
    Traceback (most recent call last):
    ...
    overdrive._utils.errors.UsageError: Outer: unknown key(s) ['colour']; known keys: ['inner', 'dtype', 'names']
"""

# no ``from __future__ import annotations`` here: doctests take this module's future flags, and the example's
# classes need evaluated annotations for get_type_hints to see them
import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import torch

from overdrive._utils.errors import UsageError

C = TypeVar("C", bound="ConfigBase")


class ConfigBase:
    """Mixin for frozen dataclass configs: ``to_dict``/``from_dict``, ``to_json``/``from_json``, ``replace``.

    ``to_dict()`` is JSON-safe: tuples become lists, a ``torch.dtype`` its name (``"float16"``), a nested
    config its dict. ``from_dict`` refuses an unknown key with a :class:`UsageError` that names it and the
    known keys. A class whose field needs another JSON form overrides ``_encode_field`` /
    ``_decode_field`` for that field and calls ``super()`` for the others.
    """

    # json.dumps options of to_json (immutable class constants, not state)
    _JSON_INDENT: ClassVar[int | None] = None
    _JSON_SORT_KEYS: ClassVar[bool] = False
    # fields added after configs were first written: to_json leaves them out at their defaults, so JSON an
    # earlier version wrote is written again byte for byte, and earlier versions (which refuse unknown keys)
    # can read what this one writes unless a new field is set
    _ADDED_FIELDS: ClassVar[tuple[str, ...]] = ()

    # --- per-field hooks ------------------------------------------------------------------------
    def _encode_field(self, name: str, value: Any) -> Any:
        """The JSON-safe form of field ``name``."""
        return encode(value)

    @classmethod
    def _decode_field(cls, name: str, value: Any, hint: Any) -> Any:
        """Field ``name`` rebuilt from its JSON form; ``hint`` is the field's resolved type."""
        return decode(value, hint)

    # --- the round trip -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields, in declaration order, as JSON-safe values."""
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        return {f.name: self._encode_field(f.name, getattr(self, f.name)) for f in fields}

    @classmethod
    def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
        """Build from :meth:`to_dict`'s form; a missing key takes the field's default."""
        if not isinstance(d, Mapping):
            raise UsageError(f"{cls.__name__}: expected a dict of fields, got {type(d).__name__} {d!r}")
        cls._check_keys(d)
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        missing = [n for n, f in fields.items() if f.init and n not in d
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise UsageError(f"{cls.__name__}: missing key(s) {missing}; known keys: {list(fields)}")
        hints = typing.get_type_hints(cls)
        return cls(**{k: cls._decode_field(k, v, hints.get(k, Any)) for k, v in d.items()})

    def to_json(self) -> str:
        return json.dumps(self._json_dict(), indent=self._JSON_INDENT, sort_keys=self._JSON_SORT_KEYS)

    def _json_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without the added fields at their defaults, in nested configs too."""
        out = self.to_dict()
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        for f in fields:
            value = getattr(self, f.name)
            if isinstance(value, ConfigBase) and isinstance(out.get(f.name), dict):
                out[f.name] = value._json_dict()
        defaults = {f.name: f.default for f in fields}
        for name in self._ADDED_FIELDS:
            if out[name] == self._encode_field(name, defaults[name]):
                del out[name]
        return out

    @classmethod
    def from_json(cls: type[C], text: str | bytes) -> C:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{cls.__name__}: the text is not valid JSON ({exc}); give what to_json() wrote") from exc
        return cls.from_dict(data)

    def replace(self: C, **changes: Any) -> C:
        """A copy with some fields changed (configs are frozen); validated like a new one."""
        type(self)._check_keys(changes)
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def _check_keys(cls, keys: Iterable[str]) -> None:
        known = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        bad = sorted(set(keys) - set(known))
        if bad:
            raise UsageError(f"{cls.__name__}: unknown key(s) {bad}; known keys: {known}")


def encode(value: Any) -> Any:
    """A value in its JSON-safe form: configs -> dicts, dtypes -> names, tuples -> lists (recursively)."""
    if isinstance(value, ConfigBase):
        return value.to_dict()
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    return value


def decode(value: Any, hint: Any) -> Any:
    """Rebuild ``value`` as the type ``hint`` says: dicts into configs, names into dtypes, lists into tuples.

    A value that does not fit the hint is returned as it is, so that ``__post_init__`` names what is wrong.
    """
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(hint):
            if _fits(value, arg):
                return decode(value, arg)
        return value
    if isinstance(hint, type) and issubclass(hint, ConfigBase) and isinstance(value, Mapping):
        return hint.from_dict(value)
    if hint is torch.dtype and isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) else value
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        if origin is list:
            return [decode(v, args[0] if args else Any) for v in value]
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
            return tuple(decode(v, args[0]) for v in value)
        if args and len(args) == len(value):  # tuple[X, Y]: one type per place
            return tuple(decode(v, a) for v, a in zip(value, args))
        return tuple(value)
    return value


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``decode`` would convert ``value`` for this member of a union."""
    if isinstance(value, Mapping):
        return isinstance(hint, type) and issubclass(hint, ConfigBase)
    if isinstance(value, str):
        return hint is torch.dtype
    if isinstance(value, (list, tuple)):
        return typing.get_origin(hint) in (tuple, list)
    return False
