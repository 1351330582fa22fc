"""ModelOpt's ``quant_cfg`` in both of its forms, read into one ordered list of rules.

Current ModelOpt writes ``quant_cfg`` as an ordered list of entries::

    [{"quantizer_name": "*", "enable": False},
     {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
     {"quantizer_name": "*input_quantizer", "parent_class": "nn.Linear", "enable": False}]

Entries apply in order and a later one overrides an earlier one for the quantizers both match. An entry with
``cfg`` replaces the quantizer's attributes completely (what ``cfg`` leaves out takes its default: int8, per
tensor) and turns it on unless ``enable`` says otherwise; an entry with only ``enable`` switches the quantizer on
or off and keeps its attributes. ``parent_class`` keeps an entry to quantizers whose owning layer is of that class.

Older ModelOpt wrote a dict, ``{"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False},
"nn.Linear": {"*input_quantizer": {"enable": False}}}``. It is read as those versions applied it: ``"default"``
first (as ``"*"``), then each key in order; a value with attributes is a ``cfg`` entry, a value with only
``enable`` an enable-only entry, an ``"nn.X"`` key one entry per inner pattern with ``parent_class="nn.X"``.

The presets (``mtq.INT8_DEFAULT_CFG``, ...) hold their ``quant_cfg`` as a :class:`QuantCfgList`: a list of entries
in the current form, which also takes the old dict-style edits, so scripts of both generations run on a
``copy.deepcopy`` of a preset.

Example:
    >>> cfg = QuantCfgList([{"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}}])
    >>> cfg["*lm_head*"] = {"enable": False}                    # old style: a new key appends an entry
    >>> cfg.append({"quantizer_name": "*head*", "enable": False})  # new style
    >>> cfg["*weight_quantizer"]["axis"] = None                  # old style: edits the entry in place
    >>> cfg[0]
    {'quantizer_name': '*weight_quantizer', 'cfg': {'num_bits': 8, 'axis': None}}
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from overdrive._utils.errors import UsageError

_ENTRY_KEYS = ("quantizer_name", "parent_class", "cfg", "enable")
_EXAMPLE = '{"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}}'


class QuantCfgList(list):
    """A ``quant_cfg`` list of entries (ModelOpt's current form) that also takes the old dict-form edits.

    Integer indices, slices, ``append``, ``extend``, ``insert`` and iteration are the list's. A string key is an
    old ``quant_cfg`` dict key:

    - ``cfg["*lm_head*"] = {"enable": False}`` replaces the entry with that ``quantizer_name`` where it stands,
      or appends one (a dict's new key goes last; appending makes it win over the entries before it, as it did);
      ``cfg["default"] = ...`` is the ``"*"`` entry, first in the list; ``cfg["nn.Linear"] = {"*input*": {...}}``
      gives entries with ``parent_class="nn.Linear"``.
    - ``cfg["*weight_quantizer"]`` is that entry's attributes as the old flat dict (``{"num_bits": 8, "axis": 0}``,
      ``"enable"`` included when set); edits to it change the entry (it is kept as the entry's ``"cfg"``, which
      may hold ``"enable"``). The last entry with that exact name (no wildcard matching), as ModelOpt's
      ``find_quant_cfg_entry_by_path``; KeyError if none.
    - ``in``, ``del``, ``get``, ``pop``, ``update``, ``keys``, ``items`` and ``values`` by key, as on the dict.

    Example:
        >>> cfg = QuantCfgList([{"quantizer_name": "*", "enable": False}])
        >>> cfg["*input_quantizer"] = {"num_bits": 8, "axis": None}
        >>> "*input_quantizer" in cfg, cfg["default"], len(cfg)
        (True, {'enable': False}, 2)
    """

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if not _is_key(key):
            return super().__getitem__(key)
        at = self._indices(key)
        if not at:
            raise KeyError(key)
        if isinstance(key, str) and key.startswith("nn."):
            out: dict[str, Any] = {}
            for e in (list.__getitem__(self, i) for i in at):
                out.update({e["quantizer_name"]: self._flat(e)} if "quantizer_name" in e else e[key])
            return out
        return self._flat(list.__getitem__(self, at[-1]))

    def __setitem__(self, key: Any, value: Any) -> None:  # type: ignore[override]
        if not _is_key(key):
            super().__setitem__(key, value)
            return
        new = _legacy_entries(key, value, store=True)
        if isinstance(key, str) and key.startswith("nn."):
            at = self._indices(key)
            for i in reversed(at):
                super().__delitem__(i)
            pos = at[0] if at else len(self)
            super().__setitem__(slice(pos, pos), new)
            return
        at = self._indices(key)
        if at:
            super().__setitem__(at[-1], new[0])
        elif key == "default":
            self.insert(0, new[0])  # the old dict form applied "default" before every other key
        else:
            self.append(new[0])

    def __delitem__(self, key: Any) -> None:  # type: ignore[override]
        if not _is_key(key):
            super().__delitem__(key)
            return
        at = self._indices(key)
        if not at:
            raise KeyError(key)
        for i in reversed(at):
            super().__delitem__(i)

    def __contains__(self, key: object) -> bool:
        if _is_key(key):
            return bool(self._indices(key))
        return super().__contains__(key)

    def get(self, key: str, default: Any = None) -> Any:
        """The old dict's ``get``: the flat attributes of entry ``key``, or ``default``."""
        try:
            return self[key]
        except KeyError:
            return default

    def pop(self, key: Any = -1, *default: Any) -> Any:  # type: ignore[override]
        """``pop()`` / ``pop(i)`` as on a list; ``pop("*lm_head*"[, default])`` as on the old dict."""
        if not _is_key(key):
            return super().pop(key)
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        value = self[key]
        del self[key]
        return value

    def update(self, other: Mapping[str, Any] | Iterable[Any] = (), **kwargs: Any) -> None:
        """The old dict's ``update``: each key set as by ``cfg[key] = value``; a list of entries is appended."""
        if isinstance(other, Mapping):
            for k, v in other.items():
                self[k] = v
        else:
            self.extend(other)
        for k, v in kwargs.items():
            self[k] = v

    def keys(self) -> list[str]:
        """The old dict's keys, in order (each once)."""
        out: list[str] = []
        for e in self._entries():
            k = self._key_of(e)
            if _is_key(k) and k not in out:
                out.append(k)
        return out

    def values(self) -> list[Any]:
        return [self[k] for k in self.keys()]

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self[k]) for k in self.keys()]

    def copy(self) -> QuantCfgList:
        return type(self)(super().copy())

    def _entries(self) -> Iterator[Any]:
        return iter(list(list.__iter__(self)))

    @staticmethod
    def _key_of(entry: Any) -> Any:
        """The old dict key of an entry: its parent_class if it has one, else its quantizer_name ("*" for
        "default"); an old single-key entry's key."""
        if not isinstance(entry, Mapping):
            return None
        if "quantizer_name" not in entry:
            return next(iter(entry), None) if len(entry) == 1 else None
        return entry.get("parent_class") or entry["quantizer_name"]

    def _indices(self, key: Any) -> list[int]:
        """Where the entries of old dict key ``key`` are ("default" is the unscoped "*" entry; a filter function
        by identity)."""
        names = ("*", "default") if isinstance(key, str) and key in ("*", "default") else (key,)
        return [i for i, e in enumerate(self._entries()) if any(self._key_of(e) is n or (
            isinstance(n, str) and self._key_of(e) == n) for n in names)]

    def _flat(self, entry: Any) -> Any:
        """The entry's attributes as the old flat dict, kept as the entry's ``cfg`` so edits reach it."""
        if "quantizer_name" not in entry:  # an old single-key entry inside the list: its value is the flat dict
            return next(iter(entry.values()))
        cfg = entry.get("cfg")
        if isinstance(cfg, list):
            return cfg
        cfg = {} if cfg is None else cfg
        if "enable" in entry:
            cfg["enable"] = entry.pop("enable")
        entry["cfg"] = cfg
        return cfg


def _is_key(key: object) -> bool:
    """An old ``quant_cfg`` dict key: a wildcard string or a filter function of the quantizer name (ModelOpt's
    dict form takes both); an int or slice indexes the list."""
    return isinstance(key, str) or (callable(key) and not isinstance(key, type))


def _legacy_entries(key: Any, value: Any, store: bool = False) -> list[dict[str, Any]]:
    """One old dict pair as new-form entries. ``store``: keep ``value`` itself as the entry's ``cfg`` (what a
    QuantCfgList's ``cfg[key] = value`` does, so later edits to ``value`` reach the entry as they reached the old
    dict); otherwise split ``enable`` out of a copy."""
    name = "*" if key == "default" else key
    if isinstance(key, str) and key.startswith("nn."):
        if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
            raise UsageError(f"quant_cfg[{key!r}] = {value!r}: a class-scoped key takes a dict of patterns to "
                             f'attributes, e.g. {{"{key}": {{"*input_quantizer": {{"enable": False}}}}}}')
        return [{"quantizer_name": p, "parent_class": key, **_split(v, store)} for p, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [{"quantizer_name": name, "cfg": value}]
    if not isinstance(value, Mapping):
        raise UsageError(f"quant_cfg[{key!r}] = {value!r} must be a dict of quantizer attributes, e.g. "
                         '{"num_bits": 8, "axis": None} or {"enable": False}')
    return [{"quantizer_name": name, **_split(value, store)}]


def _split(value: Mapping[str, Any], store: bool) -> dict[str, Any]:
    if store and isinstance(value, dict):
        return {"cfg": value}
    cfg = {k: v for k, v in value.items() if k != "enable"}
    return {**({"cfg": cfg} if cfg else {}), **({"enable": value["enable"]} if "enable" in value else {})}


@dataclass(frozen=True)
class Rule:
    """One normalized ``quant_cfg`` entry: ``cfg`` None for an enable-only entry."""

    quantizer_name: str | Callable[[str], bool]
    parent_class: str | None
    cfg: dict[str, Any] | None
    enable: bool
    label: str  # where it came from, for error messages: quant_cfg[2] or quant_cfg['*weight_quantizer']
    parent_type: type | None = None

    def matches(self, name: str, owner: nn.Module) -> bool:
        """Whether this entry applies to quantizer ``name`` owned by layer ``owner``."""
        pattern = self.quantizer_name
        if not (pattern(name) if callable(pattern) else fnmatch.fnmatch(name, pattern)):
            return False
        return self.parent_type is None or isinstance(owner, self.parent_type)


def parent_class_type(name: str) -> type:
    """The module class a ``parent_class`` name stands for: ``"nn.<Name>"`` for a ``torch.nn`` class, or a class
    registered with ``mtq.register`` (by its name); a UsageError for any other name.

    Example:
        >>> parent_class_type("nn.Conv2d").__name__
        'Conv2d'
    """
    from overdrive.quant.modelopt.nn import QuantModuleRegistry

    if isinstance(name, str):
        registered = QuantModuleRegistry.get(name[3:] if name.startswith("nn.") else name)
        if registered is not None:
            return registered
        cls = getattr(nn, name[3:], None) if name.startswith("nn.") else None
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    raise UsageError(f"parent_class={name!r} is not a module class mtq knows; expected 'nn.<a torch.nn class>' "
                     "(e.g. 'nn.Linear', 'nn.Conv2d') or the name of a class registered with mtq.register; fix "
                     "the name, or register the class first")


def rules(quant_cfg: Any) -> list[Rule]:
    """``quant_cfg`` in either form as the ordered rules to apply; a UsageError for a malformed entry, an
    unknown ``parent_class`` or a sequential (list) ``cfg``, before anything is applied."""
    if isinstance(quant_cfg, Mapping):  # the old dict form: "default" first, then every key in order
        pairs = sorted(quant_cfg.items(), key=lambda kv: kv[0] != "default")
        raw = [(f"quant_cfg[{k!r}]", e) for k, v in pairs for e in _legacy_entries(k, v)]
    elif isinstance(quant_cfg, (list, tuple)):
        raw = []
        for i, entry in enumerate(quant_cfg):
            if isinstance(entry, Mapping) and "quantizer_name" not in entry and (
                    len(entry) == 1 or any(str(k).startswith("nn.") for k in entry)):
                raw += [(f"quant_cfg[{i}]", e) for k, v in entry.items() for e in _legacy_entries(k, v)]
            else:
                raw.append((f"quant_cfg[{i}]", entry))
    else:
        raise UsageError(f"quant_cfg must be a list of entries like {_EXAMPLE} (or an old-style dict of patterns); "
                         f"got {type(quant_cfg).__name__}")
    return [_rule(label, entry) for label, entry in raw]


def _rule(label: str, entry: Any) -> Rule:
    if not isinstance(entry, Mapping) or "quantizer_name" not in entry:
        raise UsageError(f"{label} = {entry!r} is not a quant_cfg entry; each entry is a dict like {_EXAMPLE} "
                         '(or {"quantizer_name": "*lm_head*", "enable": False})')
    bad = [k for k in entry if k not in _ENTRY_KEYS]
    if bad:
        raise UsageError(f"{label} has unknown key(s) {bad}; an entry has {list(_ENTRY_KEYS)} (quantizer "
                         "attributes such as num_bits go inside 'cfg')")
    name = entry["quantizer_name"]
    if not (isinstance(name, str) or callable(name)):
        raise UsageError(f"{label}: quantizer_name={name!r} must be a wildcard string such as '*weight_quantizer'")
    label = f"{label} ({name!r})" if isinstance(name, str) and name not in label else label
    cfg = entry.get("cfg")
    if isinstance(cfg, (list, tuple)):
        raise UsageError(f"{label}: cfg is a list ({len(cfg)} formats in sequence, ModelOpt's SequentialQuantizer "
                         "for W4A8), which mtq does not support; give cfg one dict of attributes, e.g. "
                         '{"num_bits": 8, "axis": 0}')
    if cfg is not None and not isinstance(cfg, Mapping):
        raise UsageError(f"{label}: cfg={cfg!r} must be a dict of quantizer attributes, e.g. "
                         '{"num_bits": 8, "axis": 0}')
    cfg = None if cfg is None else dict(cfg)
    enable = entry.get("enable")
    if cfg is not None and "enable" in cfg:  # an old-style edit wrote "enable" among the attributes
        inner = cfg.pop("enable")
        if enable is not None and enable != inner:
            raise UsageError(f"{label} says enable={enable!r} and cfg['enable']={inner!r}; keep one of them")
        enable, inner_only = inner, not cfg
        if inner_only:
            cfg = None  # {"enable": ...} alone: switch on or off only
    elif cfg is not None and not cfg:
        if enable is not False:
            raise UsageError(f"{label}: cfg is empty; name at least one attribute (e.g. {{'num_bits': 8}}), or "
                             "drop cfg and give enable=True to switch the quantizers on as they are")
        cfg = None
    if cfg is None and enable is None:
        raise UsageError(f"{label} has neither 'cfg' nor 'enable'; add one, e.g. "
                         f'{{"quantizer_name": {name!r}, "enable": False}}')
    if not isinstance(enable if enable is not None else True, bool):
        raise UsageError(f"{label}: enable={enable!r} must be True or False")
    parent = entry.get("parent_class")
    try:
        parent_type = parent_class_type(parent) if parent else None
    except UsageError as err:
        raise UsageError(f"{label}: {err}") from None
    return Rule(name, parent, cfg, True if enable is None else enable, label, parent_type)


def normalize_quant_cfg_list(quant_cfg: Any) -> list[dict[str, Any]]:
    """``quant_cfg`` in either form as a list of complete entries (``quantizer_name``, ``parent_class``, ``cfg``
    or None, ``enable``), checked as ``mtq.quantize`` checks it (ModelOpt's function of the same name).

    Example:
        >>> normalize_quant_cfg_list({"*weight_quantizer": {"num_bits": 8}, "default": {"enable": False}})[0]
        {'quantizer_name': '*', 'parent_class': None, 'cfg': None, 'enable': False}
    """
    return [{"quantizer_name": r.quantizer_name, "parent_class": r.parent_class, "cfg": r.cfg, "enable": r.enable}
            for r in rules(quant_cfg)]


def find_quant_cfg_entry_by_path(quant_cfg_list: list[Any], quantizer_name: str) -> Any:
    """The last entry whose ``quantizer_name`` is exactly ``quantizer_name`` (no wildcard matching), as ModelOpt's
    function of the same name; KeyError if none.

    Example:
        >>> import copy, overdrive.quant.modelopt as mtq
        >>> cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
        >>> find_quant_cfg_entry_by_path(cfg["quant_cfg"], "*weight_quantizer")["cfg"]
        {'num_bits': 8, 'axis': 0}
    """
    found = None
    for entry in quant_cfg_list:
        if isinstance(entry, Mapping) and entry.get("quantizer_name") == quantizer_name:
            found = entry
    if found is None:
        raise KeyError(f"no quant_cfg entry with quantizer_name={quantizer_name!r}")
    return found


__all__ = ["QuantCfgList", "Rule", "rules", "parent_class_type", "normalize_quant_cfg_list",
           "find_quant_cfg_entry_by_path"]
