"""Demo stage: a Hugging Face BERT encoder through engines with dynamic shapes, against plain PyTorch in the
same run (eager, and ``torch.compile(dynamic=True)``, mode "reduce-overhead" on a GPU).

One engine per precision is built once for batch 1..B and sequence 1..max (a dynamic profile on
``input_ids`` and ``attention_mask``) and run at each of the workload's sequence lengths, on batches whose
rows are padded to different lengths, as a tokenizer's are. Accuracy is the mean cosine, over the attended
tokens of held-out batches, between a run's ``last_hidden_state`` and that of the fp32 model in eager mode;
engines add the check they ran on their own at build time (``engine.info["accuracy"]``: int8/fp8 on the
calibration batches, float builds on the example inputs).

Every run is timed in interleaved rounds at each length (eager, torch.compile, each engine, then again), so a
change in the machine's load during the stage (a shared CPU) falls on all of them alike, not on whichever ran
then.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from overdrive._utils.errors import MissingDependencyError
from overdrive._utils.optional import is_available
from overdrive._utils.table import Table
from overdrive._utils.timing import median, time_fn
from overdrive.demo.context import DemoContext, StageSkipped
from overdrive.demo.engine_stage import layer_notes
from overdrive.demo.workloads import TransformerWorkload, choose_transformer
from overdrive.engine import Builder, BuildConfig, ShapeProfile

NAMES = ["input_ids", "attention_mask"]
COLUMNS = ["run", "backend", "seq", "median ms", "ms IQR", "vs eager", "vs torch.compile", "token cosine",
           "build cosine", "build s", "note"]
Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids, attention_mask: (B, S) int64 each
ROUNDS = 5  # interleaved timing rounds per sequence length
SETTLE_S = 0.05  # CPU: pause before each round (eager right after an ONNX Runtime call ran 2-4x slower here)


@dataclass
class _Run:
    """One row group: a baseline or an engine, what it took to build, and per length its results or error."""

    label: str
    backend: str
    fn: Callable[[torch.Tensor, torch.Tensor], Any] | None  # None: it did not build
    build_s: float | None = None
    build_cos: float | None = None
    note: str | None = None
    build_on: str | None = None  # what the build check ran on (engine.info["accuracy"]["on"])
    first_call_is_build: bool = False  # torch.compile: its first call at a length is where it compiles
    cos: dict[int, float] = field(default_factory=dict)
    first_s: dict[int, float] = field(default_factory=dict)
    samples: dict[int, list[float]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    def ms(self, s: int) -> float | None:
        return 1e3 * median(self.samples[s]) if self.samples.get(s) and s not in self.errors else None

    def iqr(self, s: int) -> str | None:
        """The middle half of the timed calls at length ``s``, in ms ("fast-slow")."""
        if not self.samples.get(s) or s in self.errors:
            return None
        ts = sorted(self.samples[s])
        return f"{1e3 * ts[len(ts) // 4]:.3f}-{1e3 * ts[(3 * len(ts)) // 4]:.3f}"


def make_batch(w: TransformerWorkload, seq: int, seed: int) -> Batch:
    """Random token ids and a mask whose rows keep between half and all of ``seq`` tokens (the last row
    half), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, w.vocab, (w.batch, seq), generator=g)  # 0 is BERT's pad id
    lens = torch.randint(max(1, seq // 2), seq + 1, (w.batch,), generator=g)
    lens[-1] = max(1, seq // 2)  # at least one padded row, whatever the draw
    mask = (torch.arange(seq) < lens[:, None]).long()  # (B, S)
    return ids, mask


def token_cosine(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the attended tokens of the cosine between two (B, S, H) hidden states."""
    keep = mask.bool().reshape(-1)
    a, b = out.float().reshape(-1, out.shape[-1])[keep], ref.float().reshape(-1, ref.shape[-1])[keep]
    return F.cosine_similarity(a, b, dim=-1).mean().item()


def _hidden(out: Any) -> torch.Tensor:
    """last_hidden_state of a model output, a compiled model's, or an engine's (its EngineOutput by key)."""
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "last_hidden_state", out)


def _error(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def check_note(acc: dict[str, Any]) -> str | None:
    """A row's note from its build check (``engine.info["accuracy"]``): which bar it missed, or why it was skipped.

    Example:
        >>> check_note({"passed": False, "cosine": 0.995, "min_cosine": 0.99, "worst_cosine": 0.5,
        ...             "min_worst_cosine": 0.9})
        "build check failed: worst sample's cosine 0.5000 below 0.9"
        >>> check_note({"passed": False, "cosine": 0.98, "min_cosine": 0.99}), check_note({"passed": True})
        ("below the build check's min cosine 0.99", None)
    """
    if acc.get("passed") is False:
        cos, bar, worst, floor = (acc.get(k) for k in ("cosine", "min_cosine", "worst_cosine", "min_worst_cosine"))
        if None not in (cos, bar, worst, floor) and cos >= bar:  # the mean passed: one sample fell below its floor
            return f"build check failed: worst sample's cosine {worst:.4f} below {floor}"
        return f"below the build check's min cosine {bar}"
    if acc.get("passed") is None and acc.get("skipped"):
        return f"build check skipped: {acc['skipped']}"
    return None


def _build_on(runs: list[_Run]) -> str:
    """What each engine's build check ran on, for the note under the table ("" when no engine recorded one).

    Example:
        >>> _build_on([_Run("engine fp32", "onnxruntime", None, build_on="example inputs"),
        ...            _Run("engine int8", "onnxruntime", None, build_on="calibration data")])
        '; engine fp32 on example inputs, engine int8 on calibration data'
    """
    said = [f"{r.label} on {r.build_on}" for r in runs if r.build_on]
    return "; " + ", ".join(said) if said else ""


def _candidates(cuda: bool, fp8: bool) -> list[tuple[str, str]]:
    """(precision, backend) of the engines this device builds."""
    if cuda:
        return [("fp16", "inductor"), ("int8", "inductor")] + ([("fp8", "inductor")] if fp8 else [])
    return [("fp32", "onnxruntime"), ("int8", "onnxruntime")]


def run(ctx: DemoContext) -> Table:
    if not is_available("transformers"):
        raise StageSkipped(str(MissingDependencyError("transformers", "text", "the transformer demo stage")))
    dev, cuda = ctx.device, ctx.device.type == "cuda"
    w = choose_transformer(dev, quick=ctx.workload.quick)  # type: ignore[union-attr]
    model = w.make_model(ctx.seed).to(dev)  # eager fp32: the accuracy reference, and what the engines are built from
    table = Table(f"Transformer engines (overdrive.engine): {w.name}, {dev.type}, batch {w.batch}, "
                  f"sequence {', '.join(map(str, w.seqs))}", COLUMNS, stage="transformer")
    held = {s: [tuple(t.to(dev) for t in make_batch(w, s, ctx.seed + 2000 + 97 * s + i)) for i in range(w.held_out)]
            for s in w.seqs}
    with torch.no_grad():
        refs = {s: [_hidden(model(input_ids=i, attention_mask=m)).float() for i, m in held[s]] for s in w.seqs}

    # plain PyTorch, same run: what a user has without overdrive
    eager = copy.deepcopy(model).to(dtype=torch.float16) if cuda else model
    mode = "reduce-overhead" if cuda else "default"
    runs = [_Run("PyTorch eager " + ("fp16" if cuda else "fp32"), "-", lambda i, m: eager(input_ids=i, attention_mask=m))]
    compile_label = f"torch.compile(mode={mode!r}, dynamic=True)" + (" fp16" if cuda else "")
    try:
        compiled = torch.compile(eager, mode=mode, dynamic=True)  # lazy: it compiles (or fails) on its first call
        runs.append(_Run(compile_label, "-", lambda i, m: compiled(input_ids=i, attention_mask=m),
                         first_call_is_build=True))
    except Exception as exc:  # noqa: BLE001 - e.g. a Python that Dynamo does not support: a row, the engines still run
        runs.append(_Run(compile_label, "-", None, note="FAILED: " + _error(exc)))

    fp8 = cuda and torch.cuda.get_device_capability(dev) >= (8, 9)
    if cuda and not fp8:
        table.notes.append("fp8: skipped, it needs compute capability 8.9+ (Ada/Hopper)")
    B, S = w.batch, w.max_seq
    profiles = tuple(ShapeProfile(n, (1, 1), (B, S), (B, S)) for n in NAMES)
    calib = [make_batch(w, S, ctx.seed + 1000 + i) for i in range(w.calib_batches)]
    for prec, backend in _candidates(cuda, fp8):
        t0 = time.perf_counter()
        try:
            eng = Builder(BuildConfig(precision=prec, device=str(dev), backend=backend, profiles=profiles)).build(
                model, input_names=NAMES, calib=calib if prec in ("int8", "fp8") else None)
        except Exception as exc:  # noqa: BLE001 - a candidate that fails to build is a row, not the end of the stage
            runs.append(_Run(f"engine {prec}", backend, None, note="BUILD FAILED: " + _error(exc)))
            continue
        acc = eng.info.get("accuracy") or {}
        note = check_note(acc)
        table.notes.extend(layer_notes(prec, eng.info))  # where its layers ran; its whole-engine timing (CUDA)
        # timed as a user calls it: inputs checked against the profile, outputs copied out of the engine's buffers
        runs.append(_Run(f"engine {prec}", eng.info["backend"], lambda i, m, eng=eng: eng(i, m),
                         time.perf_counter() - t0, acc.get("cosine"), note, acc.get("on")))

    built = [(r, r.fn) for r in runs if r.fn is not None]
    with torch.no_grad():
        for s in w.seqs:
            for r, fn in built:  # accuracy on every held-out batch; torch.compile compiles on the first call
                try:
                    t0 = time.perf_counter()
                    # .float() copies fp16 outputs, which CUDA graphs overwrite on the next replay; fp32 ones are
                    # CPU eager/compile outputs or an engine's copies
                    outs = [_hidden(fn(*held[s][0])).float()]
                    r.first_s[s] = time.perf_counter() - t0
                    outs += [_hidden(fn(*b)).float() for b in held[s][1:]]
                    r.cos[s] = token_cosine(torch.cat(outs), torch.cat(refs[s]), torch.cat([m for _, m in held[s]]))
                except Exception as exc:  # noqa: BLE001 - one run failing at one length still leaves the other rows
                    r.errors[s] = _error(exc)
            for k in range(ROUNDS):
                for r, fn in ((r, fn) for r, fn in built if s not in r.errors):
                    if not cuda:  # the last run's pool threads spin on after it returns (ONNX Runtime's,
                        time.sleep(SETTLE_S)  # OpenMP's) and would take the cores from this run's first calls
                    try:
                        r.samples.setdefault(s, []).extend(time_fn(lambda fn=fn: fn(*held[s][0]), dev,
                                                                   warmup=3 if k == 0 else 1,
                                                                   repeat=-(-w.repeat // ROUNDS)))
                    except Exception as exc:  # noqa: BLE001
                        r.errors[s] = _error(exc)

    base, comp = runs[0], runs[1]
    for r in runs:
        if r.fn is None:
            table.rows.append([r.label, r.backend, None, None, None, None, None, None, None, None, r.note])
            continue
        for s in w.seqs:
            ms, b, c = r.ms(s), base.ms(s), comp.ms(s)
            table.rows.append([r.label, r.backend, s, ms, r.iqr(s), b / ms if b and ms else None, c / ms if c and ms else None,
                               r.cos.get(s), r.build_cos, r.first_s.get(s) if r.first_call_is_build else r.build_s,
                               r.errors.get(s, r.note)])
    # the report's chart: the longest sequence (the profile's opt shape); the table has every length
    b, c = base.ms(S), comp.ms(S)
    if b and c:
        table.add_speedup(f"torch.compile seq {S}", b / c, base.label)
    for r in runs[2:]:
        ms = r.ms(S) if r.fn is not None else None
        if ms and b:
            table.add_speedup(f"{r.label} seq {S}", b / ms, base.label)
        if ms and c:
            table.add_speedup(f"{r.label} seq {S}", c / ms, "torch.compile")
    table.notes += [
        f"{w.name}: random init from a BertConfig (nothing downloaded); rows of each batch padded to between half "
        "and all of the sequence (attention_mask).",
        f"median ms: median of {ROUNDS * -(-w.repeat // ROUNDS)} timed calls at batch {B} and that sequence length, "
        f"in {ROUNDS} rounds that interleave the runs, inputs already on the {dev.type} ('ms IQR': the middle half)"
        f"{' (CUDA events)' if cuda else f', {1e3 * SETTLE_S:.0f} ms idle before each round'}; vs eager / vs torch.compile: their median at the same shape in this "
        "run over this row's (> 1 is faster); engines timed through engine(input_ids, attention_mask), the call a "
        "user makes.",
        f"token cosine: mean over the attended tokens of {w.held_out} held-out batches of the cosine between "
        "last_hidden_state and PyTorch eager fp32's; build cosine: the engine's own check at build time "
        "(engine.info['accuracy']: the mean over samples of the cosine to the fp32 model" + _build_on(runs) + ").",
        f"one engine per precision, built once for batch 1..{B} and sequence 1..{S}; int8/fp8 calibrated on "
        f"{len(calib)} batches of {B}x{S} tokens; build s: the build (torch.compile: its first call at that "
        "length, where it compiles).",
    ]
    if not cuda:
        table.notes.append("CPU engines run on ONNX Runtime; inductor engines are not built on a CPU (each build "
                           "exports the model and compiles C++: tens of seconds per precision on two cores, more "
                           "than this stage's budget); `python benchmarks/transformer_engines.py --device cpu` "
                           "times them.")
    return table
