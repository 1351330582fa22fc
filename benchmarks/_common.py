"""Shared benchmark helpers: CUDA-event timing, device facts, writing JSON + markdown results."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        facts.update(device=p.name, compute_capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    else:
        facts.update(device=f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    return facts


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds per call of ``step``: CUDA events on GPU, perf_counter on CPU; after ``warmup`` calls."""
    from overdrive._utils.timing import time_fn

    return time_fn(step, device, warmup=warmup, repeat=iters)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_results(name: str, facts: dict[str, Any], rows: list[dict[str, Any]], columns: list[str],
                  notes: list[str], extra: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """benchmarks/results/<name>.json and .md (and a copy into $OUT when set)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {**facts, "rows": rows, "notes": notes, **(extra or {})}
    jpath = RESULTS / f"{name}.json"
    jpath.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md = [f"# {name}", "", f"- device: {facts.get('device')} (cc {facts.get('compute_capability', '-')})",
          f"- torch {facts['torch']}, CUDA {facts.get('cuda', '-')}, python {facts['python']}",
          f"- date: {facts['date']}", f"- command: `{facts['command']}`", "",
          "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        md.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    md += [""] + [f"- {n}" for n in notes]
    mpath = RESULTS / f"{name}.md"
    mpath.write_text("\n".join(md) + "\n")
    out = os.environ.get("OUT")
    if out:
        for p in (jpath, mpath):
            shutil.copy(p, Path(out) / p.name)
    return jpath, mpath


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}"
    return str(v)
