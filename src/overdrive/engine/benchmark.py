"""trtexec-style timing of an engine: per-iteration H2D, compute, D2H and enqueue times, a summary
in trtexec's layout, and the raw times / per-kernel profile as JSON.

On CUDA the copies and the compute are timed with CUDA events around each stage (inputs live in pinned
host memory, like trtexec); on CPU there are no copies (the summary prints n/a, the JSON 0) and compute is the wall time of one call.
Inputs rotate over several distinct random sets so caches do not hold one batch.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.config import check_all_dynamic_shapes
from overdrive._utils.files import atomic_write

_STAGES = ("latency", "enqueue", "h2d", "compute", "d2h")


def _stats(xs: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    s = sorted(xs)
    out = {"min": s[0], "max": s[-1], "mean": statistics.fmean(s), "median": statistics.median(s)}
    for p in percentiles:  # nearest rank: the smallest value with at least p% of the samples at or below it
        out[f"p{p:g}"] = s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s) - 1e-9) - 1))]
    return out


def check_percentiles(percentiles: tuple[float, ...]) -> None:
    """Refuse percentiles outside [0, 100] (and NaN), which the nearest-rank pick would clamp silently."""
    bad = [p for p in percentiles if not 0 <= p <= 100]  # NaN fails the test too
    if bad:
        raise UsageError(f"--percentile {', '.join(f'{p:g}' for p in bad)}: percentiles must be between 0 and 100 "
                         "(for example 50,90,99)")


def check_cuda_graph(device_type: str, backend: str) -> None:
    """trtexec's --useCudaGraph: inductor engines on CUDA always replay CUDA graphs; anywhere else there
    are none to turn on, which is refused rather than accepted and ignored."""
    if device_type != "cuda":
        raise UsageError(f"--use-cuda-graph: this engine runs on {device_type}; CUDA graphs exist on CUDA devices "
                         "only (drop the flag, or load a CUDA engine with --device cuda)")
    if backend != "inductor":
        raise UsageError(f"--use-cuda-graph: the {backend} backend records no CUDA graphs; inductor engines on "
                         "CUDA replay them always (build with --backend inductor)")


def _entries(spec: str) -> list[str]:
    return [e.strip() for e in spec.split(",") if e.strip()]


def _entry_file(entry: str) -> str | None:
    """The file of a ``name:file`` entry (names may hold ``:``, as ``input:0:x.bin``): the first split that is a file."""
    cuts = [i for i, ch in enumerate(entry) if ch == ":"]
    return next((entry[i + 1:] for i in cuts if Path(entry[i + 1:]).is_file()), None)


def check_load_inputs(spec: str | None) -> None:
    """Refuse a ``--load-inputs`` whose files do not exist before the engine loads (which can take a compile)."""
    if not spec:
        return
    if Path(spec).suffix in (".pt", ".npz") or ":" not in spec:
        if not Path(spec).is_file():
            raise UsageError(f"--load-inputs {spec!r} does not exist; give a .pt (torch.save of a tensor, a list of "
                             "tensors or a dict name -> tensor), an .npz of named arrays, or name:file.bin raw files")
        return
    for e in _entries(spec):
        if _entry_file(e.replace("'", "")) is None:
            raise UsageError(f"--load-inputs {e!r}: no such file; give name:file with an existing file, e.g. "
                             "input:input.bin (raw values in the input's dtype, as trtexec's --loadInputs)")


def load_inputs(engine: Any, spec: str, shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[torch.Tensor, ...]:
    """trtexec's ``--loadInputs``: ``name:file.bin,...`` raw files of each input's values in its binding dtype, at the
    ``shapes`` given for it (default the profile's opt shape); or one ``.pt`` / ``.npz`` file (as ``compare
    --inputs``: a tensor, a list in input order, or a dict name -> tensor). Inputs are in the engine's order.

    Example:
        >>> # x.numpy().tofile("x.bin"); load_inputs(engine, "x:x.bin", {"x": (1, 3, 224, 224)})
    """
    import numpy as np

    check_load_inputs(spec)
    names = list(engine.input_names)
    if Path(spec).suffix in (".pt", ".npz") and Path(spec).is_file():
        try:  # weights_only: a data file never runs code
            if spec.endswith(".npz"):
                with np.load(spec, allow_pickle=False) as z:
                    data: Any = {k: torch.from_numpy(z[k]) for k in z.files}
            else:
                data = torch.load(spec, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a torn zip, a pickle of code, an object array
            raise UsageError(f"--load-inputs {spec}: cannot read it ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                             "expected a .pt of tensors (torch.save) or an .npz of named arrays") from exc
        if isinstance(data, torch.Tensor):
            data = (data,)
        ok = (isinstance(data, dict) and all(isinstance(v, torch.Tensor) for v in data.values())) or (
            isinstance(data, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in data))
        if not ok or not data:
            raise UsageError(f"--load-inputs {spec} holds a {type(data).__name__}, not tensors; save a tensor, a list "
                             "of tensors or a dict of input name -> tensor")
        if isinstance(data, dict):
            missing, unknown = [n for n in names if n not in data], [n for n in data if n not in names]
            if missing or unknown:
                raise UsageError(f"--load-inputs {spec}: the engine's inputs are {names}; the file has "
                                 f"{list(data)} (missing {missing}, unknown {unknown})")
            xs = tuple(data[n] for n in names)
        elif len(data) != len(names):
            raise UsageError(f"--load-inputs {spec} holds {len(data)} tensor(s); the engine takes {len(names)} {names}")
        else:
            xs = tuple(data)
        # the file's tensors carry their shapes: --shapes that say otherwise were silently ignored (the run and its
        # samples/s were at the file's batch)
        wrong = [f"{n}: file {'x'.join(map(str, x.shape))}, --shapes {'x'.join(map(str, shapes[n]))}"
                 for n, x in zip(names, xs) if shapes and n in shapes and tuple(x.shape) != tuple(shapes[n])]
        if wrong:
            raise UsageError(f"--load-inputs {spec} and --shapes disagree ({'; '.join(wrong)}); a .pt / .npz file's "
                             "tensors carry their own shapes: drop --shapes, or save the inputs at those shapes")
        return xs
    files: dict[str, str] = {}
    for e in _entries(spec):
        e = e.replace("'", "")
        name = next((n for n in sorted(names, key=len, reverse=True) if e.startswith(n + ":")), None)
        if name is None:
            raise UsageError(f"--load-inputs {e!r} names no input of this engine; its inputs are {names} "
                             "(give name:file for each)")
        files[name] = e[len(name) + 1:]
    if set(files) != set(names):
        raise UsageError(f"--load-inputs gives {sorted(files)}; the engine takes {names}: give name:file for each input")
    check_all_dynamic_shapes(engine.profiles, shapes)
    out = []
    for p, dt in zip(engine.profiles, engine.input_dtypes):
        shape = tuple((shapes or {}).get(p.name, p.opt))
        np_dt = torch.empty(0, dtype=dt).numpy().dtype
        raw = np.fromfile(files[p.name], dtype=np.uint8)
        need = int(np.prod(shape)) * np_dt.itemsize
        if raw.size != need:
            raise UsageError(f"--load-inputs {p.name}:{files[p.name]} holds {raw.size} bytes; input {p.name!r} at "
                             f"{'x'.join(map(str, shape))} {np_dt} needs {need}: give --shapes {p.name}:AxBx... matching "
                             "the file, or write the file as x.numpy().tofile(path)")
        out.append(torch.from_numpy(raw.view(np_dt).reshape(shape).copy()))
    return tuple(out)


def export_outputs(engine: Any, xs: list[torch.Tensor], path: str) -> None:
    """trtexec's ``--exportOutput``: one inference's outputs as JSON, ``[{"name", "dimensions": "AxB", "values"}]``."""
    outs = engine.runner(*xs)
    names = [o.get("name", f"output{i}") for i, o in enumerate(engine.header.get("outputs", []))]
    rows = [{"name": names[i] if i < len(names) else f"output{i}", "dimensions": "x".join(map(str, o.shape)),
             "dtype": str(o.dtype).replace("torch.", ""),
             "values": o.detach().float().cpu().reshape(-1).tolist() if o.is_floating_point() else
             o.detach().cpu().reshape(-1).tolist()} for i, o in enumerate(outs)]
    atomic_write(path, json.dumps(rows))


def benchmark(engine: Any, inputs: tuple[torch.Tensor, ...] | None = None, shapes: dict[str, tuple[int, ...]] | None = None,
              iterations: int = 10, warmup_ms: float = 200.0, duration_s: float = 3.0,
              percentiles: tuple[float, ...] = (90, 95, 99), no_data_transfers: bool = False, rotate: int = 4,
              export_times: str | None = None, export_profile: str | None = None,
              export_output: str | None = None) -> dict[str, Any]:
    """Run the engine for at least ``iterations`` and at least ``duration_s``; return trtexec's summary.
    ``export_output`` writes the outputs of the first input set (``inputs`` when given) as JSON.

    Example:
        >>> # s = engine.benchmark(duration_s=1); s["throughput_qps"], s["latency_ms"]["median"]
    """
    if iterations < 1 or not duration_s >= 0 or not warmup_ms >= 0:  # `not x >= 0` also refuses NaN
        raise UsageError(f"need iterations >= 1, duration >= 0, warm-up >= 0; got {iterations}, {duration_s}, {warmup_ms}")
    check_percentiles(percentiles)
    for flag, path in (("--export-times", export_times), ("--export-profile", export_profile),
                       ("--export-output", export_output)):
        if path and not Path(path).parent.is_dir():  # fail now, not after a --duration of timing
            raise UsageError(f"{flag} {path}: folder {str(Path(path).parent)!r} does not exist; create it or give "
                             "another path")
    if export_profile and engine.header["backend"] not in ("inductor", "onnxruntime"):
        raise UsageError(f"--export-profile covers the inductor (torch profiler) and onnxruntime (its own profiler) "
                         f"backends; this engine runs on {engine.header['backend']}")
    dev = engine.device
    cuda = dev.type == "cuda"
    if isinstance(inputs, torch.Tensor):  # one input: tuple(tensor) would split it along dim 0
        inputs = (inputs,)
    sets = [inputs] if inputs is not None else [engine.random_inputs(shapes, seed=i) for i in range(max(1, rotate))]
    sets = [engine.check_inputs(tuple(s), move=False) for s in sets]
    if cuda:
        sets = [[x.pin_memory() for x in s] for s in sets]
        dev_sets = [[x.to(dev) for x in s] for s in sets]
    else:
        dev_sets = sets
    batch = int(sets[0][0].shape[0]) if sets[0] and sets[0][0].dim() else 1
    runner = engine.runner

    # warm-up: at least warmup_ms of calls (and two when there is any); --warm-up 0 means none, as in trtexec
    t_end = time.perf_counter() + warmup_ms / 1e3
    n = 0
    while warmup_ms > 0 and (n < 2 or time.perf_counter() < t_end):
        runner(*dev_sets[n % len(dev_sets)])
        n += 1
    if cuda:
        torch.cuda.synchronize(dev)

    rec: dict[str, list[float]] = {k: [] for k in _STAGES}
    starts: list[float] = []
    # per iteration, ms from the start: enqueue start, H2D start/end, compute start/end, D2H start/end
    marks: list[tuple[float, ...]] = []
    host_outs: list[torch.Tensor] | None = None
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
    base = torch.cuda.Event(enable_timing=True) if cuda else None
    if base is not None:  # the device clock's zero, taken with the host's: stage marks are placed against it
        base.record()
    t_start = time.perf_counter()
    deadline = t_start + duration_s
    i = 0
    while i < iterations or time.perf_counter() < deadline:
        k = i % len(sets)
        t0 = time.perf_counter()
        if cuda:
            ev[0].record()
            xs = dev_sets[k] if no_data_transfers else [x.to(dev, non_blocking=True) for x in sets[k]]
            ev[1].record()
            te0 = time.perf_counter()
            outs = runner(*xs)
            te1 = time.perf_counter()
            ev[2].record()
            if not no_data_transfers:
                if host_outs is None:
                    host_outs = [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in outs]
                for h, o in zip(host_outs, outs):
                    h.copy_(o, non_blocking=True)
            ev[3].record()
            ev[3].synchronize()
            h2d, comp, d2h = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]), ev[2].elapsed_time(ev[3])
            lat = h2d + comp + d2h
            at = [base.elapsed_time(e) for e in ev]  # type: ignore[union-attr]
            marks.append(((te0 - t_start) * 1e3, at[0], at[1], at[1], at[2], at[2], at[3]))
        else:
            te0 = t0
            runner(*sets[k])
            te1 = time.perf_counter()
            h2d, d2h, comp = 0.0, 0.0, (te1 - te0) * 1e3
            lat = comp
            a, b = (te0 - t_start) * 1e3, (te1 - t_start) * 1e3  # no copies: they start and end where compute does
            marks.append((a, a, a, a, b, b, b))
        starts.append((t0 - t_start) * 1e3)
        rec["latency"].append(lat)
        rec["enqueue"].append((te1 - te0) * 1e3)
        rec["h2d"].append(h2d)
        rec["compute"].append(comp)
        rec["d2h"].append(d2h)
        i += 1
    wall = time.perf_counter() - t_start
    summary: dict[str, Any] = {
        "iterations": i, "batch": batch, "device": str(dev), "backend": engine.header["backend"],
        "precision": engine.header["precision"], "throughput_qps": i / wall, "throughput_samples_s": i * batch / wall,
        "total_host_walltime_s": wall, "total_gpu_compute_time_s": sum(rec["compute"]) / 1e3,
        "no_data_transfers": no_data_transfers,
    }
    for k in _STAGES:
        summary[f"{k}_ms"] = _stats(rec[k], percentiles)
    if export_times:
        atomic_write(export_times, json.dumps(times_rows(starts, marks, rec), indent=1))
    if export_profile:
        atomic_write(export_profile, json.dumps(profile_json(profile(engine, dev_sets[0], PROFILE_RUNS), PROFILE_RUNS),
                                                indent=1))
    if export_output:
        export_outputs(engine, dev_sets[0], export_output)
    return summary


def times_rows(starts: list[float], marks: list[tuple[float, ...]], rec: dict[str, list[float]]) -> list[dict[str, float]]:
    """``--exportTimes`` rows in trtexec's layout, ms from the start of the timed run: ``startEnqMs``/``endEnqMs``
    (host), ``startH2dMs``/``endH2dMs``, ``startComputeMs``/``endComputeMs``, ``startD2hMs``/``endD2hMs``,
    ``h2dMs``, ``computeMs``, ``d2hMs``, ``latencyMs`` (H2D + compute + D2H), ``endToEndMs`` (H2D start to D2H
    end); then ``startMs`` (iteration start) and ``enqueueMs``. On CPU the copies take 0 ms at the compute's edges.

    Example:
        >>> rec = {"latency": [2.0], "enqueue": [2.0], "h2d": [0.0], "compute": [2.0], "d2h": [0.0]}
        >>> r = times_rows([1.0], [(1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0)], rec)[0]
        >>> r["startComputeMs"], r["endComputeMs"], r["endToEndMs"]
        (1.0, 3.0, 2.0)
    """
    rows = []
    for i, (s, m) in enumerate(zip(starts, marks)):
        enq = rec["enqueue"][i]
        rows.append({"startEnqMs": m[0], "endEnqMs": m[0] + enq, "startH2dMs": m[1], "endH2dMs": m[2],
                     "startComputeMs": m[3], "endComputeMs": m[4], "startD2hMs": m[5], "endD2hMs": m[6],
                     "h2dMs": rec["h2d"][i], "computeMs": rec["compute"][i], "d2hMs": rec["d2h"][i],
                     "latencyMs": rec["latency"][i], "endToEndMs": m[6] - m[1], "startMs": s, "enqueueMs": enq})
    return rows


PROFILE_RUNS = 10
"""Calls of the separate profiling run behind ``--exportProfile``."""


def profile_json(rows: list[dict[str, Any]], runs: int) -> list[dict[str, Any]]:
    """``--exportProfile``'s file in trtexec's layout: first ``{"count": runs}`` (the profiled runs), then one row
    per layer, as tools that read trtexec's profile expect.

    Example:
        >>> profile_json([{"name": "conv", "timeMs": 2.0, "averageMs": 0.2, "count": 10, "percentage": 100.0}], 10)[0]
        {'count': 10}
    """
    return [{"count": runs}, *rows]


def profile(engine: Any, xs: list[torch.Tensor], iterations: int = PROFILE_RUNS) -> list[dict[str, Any]]:
    """Per-kernel (GPU) or per-operator (CPU) time over ``iterations`` calls, like trtexec's --exportProfile:
    rows of name, timeMs (total), averageMs (per call), count and percentage, slowest first. onnxruntime
    engines are profiled per graph node by ONNX Runtime's own profiler (the name is ``node (OpType)``)."""
    if engine.header["backend"] == "onnxruntime":
        from overdrive.engine.backends.onnxruntime import profile_nodes

        rows = profile_nodes(engine.sections["onnx"], engine.header, engine.device, xs, iterations)
        return _with_percentages(rows)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with tprofile(activities=acts) as prof:
        for _ in range(iterations):
            engine.runner(*xs)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    cuda = engine.device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key, "timeMs": us / 1e3, "averageMs": us / 1e3 / iterations, "count": e.count})
    return _with_percentages(rows)


def _with_percentages(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    total = sum(r["timeMs"] for r in rows) or 1.0
    for r in rows:
        r["percentage"] = 100 * r["timeMs"] / total
    return sorted(rows, key=lambda r: -r["timeMs"])


def format_summary(s: dict[str, Any]) -> str:
    """The summary in trtexec's text layout. What was not measured reads n/a: on CPU there are no
    host-device copies (inputs are read where they lie) and compute is host wall time, not GPU time;
    with --no-data-transfers the copies are skipped on CUDA too.

    Example:
        >>> st = {k: 1.0 for k in ("min", "max", "mean", "median")}
        >>> s = {"throughput_qps": 1.0, "throughput_samples_s": 1.0, "batch": 1, "total_host_walltime_s": 1.0,
        ...      "total_gpu_compute_time_s": 1.0, "iterations": 1, "backend": "inductor", "precision": "fp32",
        ...      "device": "cpu", **{f"{k}_ms": st for k in ("latency", "enqueue", "h2d", "compute", "d2h")}}
        >>> [ln for ln in format_summary(s).splitlines() if "H2D" in ln]
        ['[I] H2D Latency: n/a (cpu: no host-device copies)']
    """
    cuda = s["device"].startswith("cuda")
    copies = cuda and not s.get("no_data_transfers", False)
    why = "skipped (--no-data-transfers)" if cuda else f"n/a ({s['device']}: no host-device copies)"

    def line(label: str, key: str) -> str:
        st = s[f"{key}_ms"]
        pct = ", ".join(f"percentile({k[1:]}%) = {v:.5g} ms" for k, v in st.items() if k.startswith("p"))
        return (f"[I] {label}: min = {st['min']:.5g} ms, max = {st['max']:.5g} ms, mean = {st['mean']:.5g} ms, "
                f"median = {st['median']:.5g} ms, {pct}")

    return "\n".join([
        "[I] === Performance summary ===",
        f"[I] Throughput: {s['throughput_qps']:.5g} qps ({s['throughput_samples_s']:.5g} samples/s at batch {s['batch']})",
        line("Latency", "latency"),
        # on CPU a call returns when its work is done: enqueue time is the compute time, so it is not a measurement
        line("Enqueue Time", "enqueue") if cuda else f"[I] Enqueue Time: n/a ({s['device']}: calls are synchronous)",
        line("H2D Latency", "h2d") if copies else f"[I] H2D Latency: {why}",
        line("GPU Compute Time", "compute") if cuda else line("Compute Time (host wall time, CPU)", "compute"),
        line("D2H Latency", "d2h") if copies else f"[I] D2H Latency: {why}",
        f"[I] Total Host Walltime: {s['total_host_walltime_s']:.5g} s",
        f"[I] Total GPU Compute Time: {s['total_gpu_compute_time_s']:.5g} s" if cuda else
        f"[I] Total Compute Time (CPU): {s['total_gpu_compute_time_s']:.5g} s",
        f"[I] Iterations: {s['iterations']}, backend {s['backend']}, precision {s['precision']}, device {s['device']}",
    ])
