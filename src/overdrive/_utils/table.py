"""A result table: printed with rich, written as JSON and markdown. Every demo stage, recipe and benchmark returns these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Table:
    """Rows of one stage's results.

    Example:
        >>> t = Table("amp", ["level", "accuracy"], [["O0", 0.97]])
        >>> t.to_dict()["rows"]
        [{'level': 'O0', 'accuracy': 0.97}]
    """

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What the demo's report charts (none of it is printed): the stage that made the table; its
    # speed-ups, each ``{"label", "ratio", "baseline", "accuracy_delta"}`` (ratio > 1: faster than the
    # baseline measured in the same run; accuracy_delta in points against the baseline's accuracy, or
    # None); and its loss curves, name -> one value per epoch.
    stage: str = ""
    speedups: list[dict[str, Any]] = field(default_factory=list)
    curves: dict[str, list[float]] = field(default_factory=dict)
    status: str = "ok"  # "ok", "skipped" (cannot run on this machine: the notes say why) or "failed"

    def add_speedup(self, label: str, ratio: float, baseline: str, accuracy_delta: float | None = None) -> None:
        """Record ``label`` at ``ratio`` x ``baseline`` (and its accuracy change in points) for the report."""
        self.speedups.append({"label": label, "ratio": float(ratio), "baseline": baseline,
                              "accuracy_delta": None if accuracy_delta is None else float(accuracy_delta)})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [dict(zip(self.columns, r)) for r in self.rows]
        return d

    def render(self) -> Any:
        from rich.table import Table as RichTable

        t = RichTable(title=self.title, caption="\n".join(self.notes) or None, caption_justify="left")
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for r in self.rows:
            t.add_row(*[_fmt(v) for v in r])
        return t

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in self.rows]
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.4f}" if abs(v) < 1 else f"{v:.3f}"
    return "-" if v is None else str(v)
