"""How a torch.export program's dims relate to an engine's shape profiles: the ``dynamic_shapes`` a build asks
export for (dims of one size shared across inputs), and the check that export did not fix a dim the profile lets
vary, with the groups of input dims the program needs equal (checked at each call).

Example:
    >>> from overdrive.engine.config import ShapeProfile
    >>> dynamic_shapes([ShapeProfile.fixed("x", (2, 8))], ["x"]) is None
    True
"""

from __future__ import annotations

from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.config import ShapeProfile


def _dynamic_shapes(profiles: list[ShapeProfile], names: list[str]) -> tuple[dict[int, Any], ...]:
    """One ``Dim.DYNAMIC`` hint with the profile's range per dynamic dim: torch.export then infers which dims
    of different inputs must be equal (input_ids and attention_mask share the sequence length) instead of
    failing because two independently named dims turned out equal. :func:`check_exported_dims` afterwards
    refuses a dim the model fixed and reports the shared ones."""
    by = {p.name: p for p in profiles}
    out = []
    for n in names:
        p = by[n]
        # torch.export cannot keep a dim dynamic whose traced range is one value: it treats sizes 0 and 1 as
        # special, so a 1..2 batch is traced as 2..2 and refused; the program is exported for sizes up to 3 at
        # least (the engine's own profile check still holds inputs to 1..2)
        out.append({d: torch.export.Dim.DYNAMIC(min=p.min[d], max=max(p.max[d], 3)) for d in p.dynamic_dims()})
    return tuple(out)


def check_exported_dims(ep: Any, profiles: list[ShapeProfile], names: list[str]) -> list[list[list[Any]]]:
    """After ``torch.export`` with :func:`dynamic_shapes`: raise UsageError for a dim the profile lets vary but
    the model fixed (export specializes it silently), and return the groups of input dims that share one size,
    ``[[["input_ids", 1], ["attention_mask", 1]], ...]`` (engines check them at run time).

    Example:
        >>> # check_exported_dims(ep, profiles, ["input_ids", "attention_mask"])  # [[['input_ids', 1], ['attention_mask', 1]], ...]
    """
    user = list(ep.graph_signature.user_inputs)
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    by = {p.name: p for p in profiles}
    groups: dict[str, list[list[Any]]] = {}
    for name, node_name in zip(names, user):
        val = nodes[node_name].meta.get("val")
        p = by.get(name)
        if val is None or p is None:
            continue
        for d in p.dynamic_dims():
            size = val.shape[d]
            if isinstance(size, int):
                raise UsageError(f"input {name!r} dim {d}: the shape profile lets it vary ({p.min[d]}..{p.max[d]}) but "
                                 f"the model fixes it at {size} (torch.export specialized it); make that dim {size} in "
                                 "--min/--opt/--max-shapes, or change the model")
            rng = _exported_range(ep, size)
            if rng is not None and p.min[d] < 2 and rng[0] == 2:  # export's 0/1 specialization, not the model's
                rng = (p.min[d], rng[1])
            if rng is not None and (rng[1] < p.max[d] or rng[0] > p.min[d]):
                raise UsageError(f"input {name!r} dim {d}: the shape profile lets it vary ({p.min[d]}..{p.max[d]}) but "
                                 f"the model only holds for {rng[0]}..{rng[1]} (torch.export narrowed it: Python code "
                                 "branches on that size, and another branch runs outside that range); keep the profile "
                                 f"within {rng[0]}..{rng[1]}, build one engine per range, or change the model")
            groups.setdefault(str(size), []).append([name, d])
    return [g for g in groups.values() if len(g) > 1]


def _exported_range(ep: Any, size: Any) -> tuple[int, int] | None:
    """The (lower, upper) sizes ``torch.export`` kept valid for a symbolic input dim (``ep.range_constraints``), or
    None where it says nothing usable (an unbounded upper end, a dim that is an expression of others)."""
    try:
        vr = ep.range_constraints.get(size.node.expr)
        lo, hi = int(vr.lower), int(vr.upper)
    except Exception:  # noqa: BLE001 - no range kept for it, or an infinite bound
        return None
    return lo, hi


def dynamic_shapes(profiles: list[ShapeProfile], names: list[str]) -> tuple[dict[int, Any], ...] | None:
    """torch.export ``dynamic_shapes`` for the profiles (None when every profile is static)."""
    return _dynamic_shapes(profiles, names) if any(not p.static for p in profiles) else None
