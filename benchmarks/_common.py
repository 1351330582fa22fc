"""Shared benchmark helpers: CUDA-event timing, run facts, and the one results writer.

Every script writes ``benchmarks/results/<name>.json`` and ``<name>.md`` through :func:`write_results`.
The JSON is always ``{"meta": {...}, "results": {...}}``: ``meta`` holds the same keys for every
script (device, torch, CUDA, python, overdrive version, git commit, date, command line) plus the
script's own run facts; ``results`` holds what the script measured (rows, tables, named sections, notes).
The markdown file starts with the same meta as a header block.

    >>> facts = device_facts(torch.device("cpu"))
    >>> write_results("demo", facts, [{"config": "eager", "ms": 1.5}], ["config", "ms"], ["one note"])  # doctest: +SKIP
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from overdrive._utils.files import atomic_write
from overdrive._utils.git import git_state as _git_state

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]  # where `git rev-parse` runs

# The keys every results file's meta has, in this order (null where they do not apply); a script's own
# run facts (wall time, dataset, ...) follow them.
META_KEYS = ("device", "compute_capability", "torch", "cuda", "python", "overdrive", "commit", "dirty",
             "date", "command", "argv")


def git_state(cwd: str | Path | None = None) -> tuple[str | None, bool | None]:
    """(short commit, dirty) of the checkout at ``cwd`` (default: this repository): see overdrive._utils.git."""
    return _git_state(cwd or REPO)


def run_meta(device: torch.device | None = None, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The meta every results file records: device, torch, CUDA, python, overdrive, git commit, date, command.

    ``argv`` defaults to ``sys.argv``; pass it when a script's ``main(argv)`` was called with its own list.
    """
    device = device if device is not None else torch.device("cpu")
    argv = list(sys.argv if argv is None else argv)
    try:
        from overdrive import __version__ as od_version
    except ImportError:
        od_version = None
    commit, dirty = git_state()
    meta: dict[str, Any] = dict.fromkeys(META_KEYS)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(device=p.name, compute_capability=f"{p.major}.{p.minor}")
    else:
        meta["device"] = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    meta.update(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                overdrive=od_version, commit=commit, dirty=dirty,
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                command="python " + shlex.join(argv), argv=argv)
    return meta


def device_facts(device: torch.device, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """:func:`run_meta` for ``device``; scripts add their own run facts to the dict before writing."""
    return run_meta(device, argv)


def time_steps(step: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds per call of ``step``: CUDA events on GPU, perf_counter on CPU; after ``warmup`` calls."""
    from overdrive._utils.timing import time_fn

    return time_fn(step, device, warmup=warmup, repeat=iters)


def graphed_ms(fn: Callable[[], Any], device: torch.device, iters: int, calls: int = 10) -> float:
    """Median ms of one ``fn()`` as an engine runs it: ``calls`` calls captured in one CUDA graph, replayed ``iters``
    times (after 3 warm-up replays)."""
    import statistics

    fn()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return statistics.median(time_steps(g.replay, device, warmup=3, iters=iters)) * 1e3 / calls


def gpu_kernels(step: Callable[[], Any], calls: int = 5) -> dict[str, list[float]]:
    """GPU time of each kernel launch over ``calls`` calls of ``step`` (after one warm-up call), in us, by kernel
    name, from torch.profiler (CUDA graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time_total)
    return kernels


def gpu_kernel_ms(step: Callable[[], Any], calls: int = 5) -> float:
    """GPU kernel time per call of ``step`` in ms. Beside the CUDA-event time of a call it shows the host's share:
    event ms - kernel ms is the GPU waiting on Python, launches and gaps between kernels."""
    return sum(sum(v) for v in gpu_kernels(step, calls).values()) / calls / 1e3


# kernel-name patterns, first match wins: where a profiled call's GPU time goes
KERNEL_GROUPS = (
    ("overdrive int8/fp8 (Triton)", ("_conv_kernel", "_gemm_kernel")),
    ("Inductor Triton", ("triton_",)),  # before the others: Inductor names kernels after ops (fused_convolution_...)
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "mha")),
    ("GEMM (cuBLAS/CUTLASS)", ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "cublas", "matmul", "splitk")),
    ("convolution (cuDNN)", ("cudnn", "conv", "implicit", "winograd", "fprop")),
    ("copies", ("memcpy", "memset", "copy")),
)


def kernel_breakdown(kernels: dict[str, list[float]], calls: int, top: int = 12) -> dict[str, Any]:
    """:func:`gpu_kernels`'s output per call: ms by group (:data:`KERNEL_GROUPS`, else "other") and the ``top``
    kernels by total time (name cut to 90 characters, ms per call, launches per call).

    Example:
        >>> kernel_breakdown({"triton_poi_fused_add_0": [10.0, 10.0], "sm90_xmma_gemm_f16": [30.0, 30.0]}, 2)["groups_ms"]
        {'GEMM (cuBLAS/CUTLASS)': 0.03, 'Inductor Triton': 0.01}
    """
    groups: dict[str, float] = {}
    for name, times in kernels.items():
        low = name.lower()
        group = next((g for g, pats in KERNEL_GROUPS if any(p in low for p in pats)), "other")
        groups[group] = groups.get(group, 0.0) + sum(times)
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"groups_ms": {g: round(t / calls / 1e3, 4) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top": [[name[:90], round(sum(t) / calls / 1e3, 4), round(len(t) / calls, 1)] for name, t in ranked]}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_results(name: str, facts: dict[str, Any] | None = None, rows: list[dict[str, Any]] | None = None,
                  columns: list[str] | None = None, notes: Sequence[str] = (), extra: dict[str, Any] | None = None, *,
                  tables: Sequence[Any] = (), body: Sequence[str] | None = None, title: str | None = None,
                  out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.json`` and ``.md`` (default out_dir benchmarks/results; copies into $OUT when set).

    ``facts``: from :func:`device_facts`, plus the script's own run facts (missing standard keys are
    filled in). The payload, under ``results``: ``rows`` (dicts; rendered as one markdown table of
    ``columns``), ``tables`` (objects with ``to_dict``/``to_markdown``, e.g. overdrive's ``Table``),
    ``extra`` (named sections, stored as given) and ``notes``. ``body``: markdown lines that replace the
    rows table, for scripts that render their own sections. Each file is written to a temporary file
    in the same folder and moved into place, so a reader never sees half a file.
    Returns the two paths.
    """
    meta = _complete_meta(facts or {})
    results: dict[str, Any] = {}
    if rows is not None:
        results["rows"] = rows
    if tables:
        results["tables"] = [t.to_dict() if hasattr(t, "to_dict") else t for t in tables]
    clash = {"rows", "tables", "notes"} & set(extra or {})
    if clash:
        raise ValueError(f"write_results: extra uses the reserved key(s) {sorted(clash)}; pass them as rows=, "
                         "tables= or notes= instead, or rename the section")
    results.update(extra or {})
    results["notes"] = list(notes)

    md = [f"# {title or name}", "", *meta_lines(meta), ""]
    if body is not None:
        md += list(body)
    elif rows is not None and columns:
        md += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        md += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    for t in tables:
        md += ([""] if md[-1] else []) + [t.to_markdown().rstrip("\n")]
    if notes:
        md += [""] + [f"- {n}" for n in notes]

    folder = Path(out_dir) if out_dir is not None else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    texts = {f"{name}.json": json.dumps({"meta": meta, "results": results}, indent=2, default=str) + "\n",
             f"{name}.md": "\n".join(md) + "\n"}
    for fname, text in texts.items():
        write_atomic(folder / fname, text)
    out = os.environ.get("OUT")
    if out and Path(out).resolve() != folder.resolve():
        Path(out).mkdir(parents=True, exist_ok=True)
        for fname, text in texts.items():
            write_atomic(Path(out) / fname, text)
    return folder / f"{name}.json", folder / f"{name}.md"


def meta_lines(meta: dict[str, Any]) -> list[str]:
    """The markdown header block for ``meta``: the standard facts, then the script's own, one bullet each."""
    cc = f" (cc {meta['compute_capability']})" if meta.get("compute_capability") else ""
    if meta.get("commit"):
        commit = meta["commit"] + (" (with uncommitted changes)" if meta.get("dirty") else "")
    else:
        commit = "unknown (not a git checkout, or git unavailable)"
    lines = [f"- device: {meta.get('device')}{cc}",
             f"- torch {meta.get('torch')}, CUDA {meta.get('cuda') or '-'}, python {meta.get('python')}, "
             f"overdrive {meta.get('overdrive') or '-'}",
             f"- commit: {commit}", f"- date: {meta.get('date')}", f"- command: `{meta.get('command')}`"]
    lines += [f"- {k}: {_fmt(v)}" for k, v in meta.items() if k not in META_KEYS]
    return lines


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole (overdrive._utils.files.atomic_write: temporary file, fsync, rename)."""
    atomic_write(path, text)


def _complete_meta(facts: dict[str, Any]) -> dict[str, Any]:
    """The standard keys first (from ``facts``, else measured now), then the script's own facts."""
    base = run_meta() if any(k not in facts for k in META_KEYS) else {}
    meta = {k: facts[k] if k in facts else base[k] for k in META_KEYS}
    meta.update((k, v) for k, v in facts.items() if k not in META_KEYS)
    return meta


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
