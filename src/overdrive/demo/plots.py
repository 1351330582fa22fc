"""The demo's markdown report with PNG charts: speed-ups, accuracy changes and loss curves per stage.

matplotlib (the ``plot`` extra) is imported only when a report is written. Charts are drawn on a bare
``Figure`` with the Agg canvas, so neither pyplot nor the process's backend setting is touched.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path
from typing import Any

from overdrive._utils.errors import UsageError
from overdrive._utils.files import atomic_write
from overdrive._utils.optional import require
from overdrive._utils.table import Table

_DPI = 110
_WIDTH_IN = 8.0
_UP, _DOWN = "#2a9d8f", "#e76f51"  # at or above the baseline / below it


def write_report(tables: list[Table], out_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write ``out_dir/report.md`` with its charts (PNG) and ``report.json`` (what each chart shows).

    Charts: ``speedups.png`` (every speed-up of every table), ``accuracy.png`` (the accuracy changes
    in points) and one ``loss_<stage>.png`` per table with loss curves. A chart with nothing to show is
    not drawn, and the report says so. ``meta`` (device, torch, date, command...) heads the report.

    Example:
        >>> import tempfile
        >>> t = Table("AMP", ["level", "accuracy"], [["O2", 0.97]], stage="amp")
        >>> t.add_speedup("O2", 1.52, "O0", accuracy_delta=-0.1)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = write_report([t], d, {"device": "cpu"})
        ...     sorted(p.name for p in path.parent.iterdir())
        ['accuracy.png', 'report.json', 'report.md', 'speedups.png']
    """
    require("matplotlib", "plot", "the demo report's charts")
    bad = [type(t).__name__ for t in tables if not isinstance(t, Table)]
    if bad:
        raise UsageError(f"write_report takes a list of overdrive.demo.report.Table, got {bad}; "
                         "pass the tables the demo stages return")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    earlier = _earlier_charts(out)
    charts: dict[str, dict[str, Any]] = {}
    md = ["# overdrive demo report", ""] + [f"- {k}: {v}" for k, v in (meta or {}).items()] + [""]

    # (stage, label, ratio, accuracy_delta), in table order so each stage's bars stay together
    ups = [(_stage(t), f"{s['label']} vs {s.get('baseline', 'baseline')}", float(s["ratio"]), s.get("accuracy_delta"))
           for t in tables for s in t.speedups if math.isfinite(float(s["ratio"]))]
    md += ["## Speed-ups", ""]
    if ups:
        charts["speedups.png"] = _speedups(out / "speedups.png", ups)
        md += ["![Speed-up of each stage against the baseline measured in the same run](speedups.png)", ""]
    else:
        (out / "speedups.png").unlink(missing_ok=True)  # a stale chart of an earlier run in this folder
        md += ["No stage recorded a speed-up, so there is no speed-up chart.", ""]
    # every accuracy change, those of accuracy-only rows too (quant, sparsity: a NaN ratio, no speed-up bar)
    deltas = [(_stage(t), f"{s['label']} vs {s.get('baseline', 'baseline')}", float(s["accuracy_delta"]))
              for t in tables for s in t.speedups
              if s.get("accuracy_delta") is not None and math.isfinite(float(s["accuracy_delta"]))]
    md += ["## Accuracy change", ""]
    if deltas:
        charts["accuracy.png"] = _accuracy(out / "accuracy.png", deltas)
        md += ["![Accuracy change in points against each baseline](accuracy.png)", ""]
    else:
        (out / "accuracy.png").unlink(missing_ok=True)
        md += ["No stage recorded an accuracy change, so there is no accuracy chart.", ""]

    md += ["## Stages", ""]
    for t in tables:
        head, _, rest = t.to_markdown().partition("\n")
        md.append(head + (f"\n\n**{t.status}**" if t.status != "ok" else "") + "\n" + rest)
        if t.curves:
            name = _unique(f"loss_{re.sub(r'[^A-Za-z0-9_.-]+', '_', _stage(t))}.png", charts)
            charts[name] = _losses(out / name, t.curves, _stage(t))
            md += [f"![Loss per epoch: {_stage(t)}]({name})", ""]

    not_ok = _not_ok(tables)
    summary = "; ".join(f"{s}: {', '.join(v)}" for s, v in not_ok.items()) or "every stage ran"
    md += ["## Summary", "", f"**Summary:** {summary}."]
    path = out / "report.md"
    atomic_write(path, "\n".join(md) + "\n")
    info = {"report": path.name, "charts": charts, "not_ok": not_ok, "meta": meta or {}}
    atomic_write(out / "report.json", json.dumps(info, indent=2, default=str))
    for name in earlier - set(charts):  # an earlier run's loss_quant.png beside a report without that stage
        (out / name).unlink(missing_ok=True)
    return path


def _not_ok(tables: list[Table]) -> dict[str, list[str]]:
    """status -> the stages with a table of that status, each stage once and under its worst status (failed, then
    interrupted, then skipped), as the demo's summary line names them: the data stage's two tables are one stage.

    Example:
        >>> _not_ok([Table("img", [], stage="data", status="failed"), Table("tok", [], stage="data", status="skipped"),
        ...          Table("t", [], stage="transformer", status="skipped"), Table("a", [], stage="amp")])
        {'failed': ['data'], 'skipped': ['transformer']}
    """
    order = ["failed", "interrupted", "skipped"]
    order += sorted({t.status for t in tables} - {"ok", *order})  # any other status, after these

    worst: dict[str, str] = {}  # stage -> its worst status, stages in table order
    for t in (t for t in tables if t.status != "ok"):
        if _stage(t) not in worst or order.index(t.status) < order.index(worst[_stage(t)]):
            worst[_stage(t)] = t.status
    return {status: [st for st, s in worst.items() if s == status] for status in order if status in worst.values()}


def _earlier_charts(out: Path) -> set[str]:
    """The charts an earlier report in ``out`` listed in its report.json: the only files a new report replaces or
    removes, so a folder that also holds the user's own files keeps them. Plain ``*.png`` names only.

    Example:
        >>> _earlier_charts(Path("/nonexistent"))
        set()
    """
    try:
        listed = json.loads((out / "report.json").read_text(encoding="utf-8")).get("charts", {})
    except (OSError, ValueError, AttributeError):
        return set()
    if not isinstance(listed, dict):
        return set()
    return {n for n in listed if isinstance(n, str) and re.fullmatch(r"[A-Za-z0-9_.-]+\.png", n)}


def _stage(t: Table) -> str:
    return t.stage or t.title


def _unique(name: str, taken: dict[str, Any]) -> str:
    stem, i = name[:-4], 2
    while name in taken:  # two tables of one stage: loss_amp.png, loss_amp_2.png
        name, i = f"{stem}_{i}.png", i + 1
    return name


def _figure(height_in: float) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(_WIDTH_IN, height_in), dpi=_DPI, layout="constrained")
    return fig, fig.add_subplot()


def _bars_height(n: int) -> float:
    return max(2.6, 1.2 + 0.35 * n)  # 0.35 in per bar keeps labels legible however many stages there are


def _speedups(path: Path, ups: list[tuple[str, str, float, Any]]) -> dict[str, Any]:
    fig, ax = _figure(_bars_height(len(ups)))
    labels = [f"{st}: {lab}" for st, lab, _, _ in ups]
    ratios = [r for _, _, r, _ in ups]
    texts = [f"{r:.2f}x" + ("" if d is None else f" ({float(d):+.1f} pt)") for _, _, r, d in ups]
    ys = range(len(ups))
    ax.barh(ys, ratios, color=[_UP if r >= 1.0 else _DOWN for r in ratios])
    ax.axvline(1.0, color="black", lw=1, ls="--")
    for y, r, s in zip(ys, ratios, texts):
        ax.text(r, y, " " + s, va="center", fontsize=8)
    for y in (y for y in ys[1:] if ups[y][0] != ups[y - 1][0]):
        ax.axhline(y - 0.5, color="grey", lw=0.5)  # a thin rule between stages
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()  # first stage on top, as in the tables below
    ax.set_xlim(0, max(max(ratios), 1.0) * 1.35)  # room for the text at the bar ends
    ax.set_xlabel("speed-up (x, > 1 is faster than the baseline)")
    return _save(fig, path, labels=labels, texts=texts)


def _accuracy(path: Path, deltas: list[tuple[str, str, float]]) -> dict[str, Any]:
    fig, ax = _figure(_bars_height(len(deltas)))
    labels = [f"{st}: {lab}" for st, lab, _ in deltas]
    vals = [d for _, _, d in deltas]
    ys = range(len(deltas))
    ax.barh(ys, vals, color=[_UP if v >= 0 else _DOWN for v in vals])
    ax.axvline(0.0, color="black", lw=1)
    for y, v in zip(ys, vals):
        ax.text(v, y, f" {v:+.1f} pt " if v else " 0.0 pt", va="center", ha="right" if v < 0 else "left", fontsize=8)
    span = max(max(abs(v) for v in vals), 0.1) * 1.4
    ax.set_xlim(-span, span)  # symmetric, so a gain and a loss of one size look alike
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("accuracy change (points)")
    return _save(fig, path, labels=labels, values=vals)


def _losses(path: Path, curves: dict[str, list[float]], stage: str) -> dict[str, Any]:
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure(4.0)
    legend, drawn = [], []
    for name, values in curves.items():
        vals = [float(v) for v in values]
        n = next((i for i, v in enumerate(vals) if not math.isfinite(v)), len(vals))
        label = name if n == len(vals) else f"{name} (diverged)"
        (line,) = ax.plot(range(1, n + 1), vals[:n], marker="o", ms=3, label=label)
        if n < len(vals) and n:
            ax.plot([n], [vals[n - 1]], marker="x", ms=9, color=line.get_color())  # where it blew up
        legend.append(label)
        drawn += vals[:n]
    log = bool(drawn) and min(drawn) > 0 and max(drawn) / min(drawn) > 10
    if log:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="epoch", ylabel="loss", title=f"{stage}: training loss")
    ax.legend(fontsize=8)
    return _save(fig, path, legend=legend, yscale="log" if log else "linear")


def _save(fig: Any, path: Path, **shown: Any) -> dict[str, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attaches itself to fig; savefig then renders with Agg whatever the process backend
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=_DPI)
        atomic_write(path, buf.getvalue())  # a reader (an artifact upload, a browser) never sees half a file
    finally:
        fig.clear()  # a pyplot-free figure has nothing to close; drop its artists now
    w, h = fig.get_size_inches() * _DPI
    return {"width_px": round(w), "height_px": round(h), **shown}
