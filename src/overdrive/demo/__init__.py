"""``overdrive demo``: the whole path on a real dataset, one stage and one table per technique.

Example:
    >>> # from overdrive.demo import run_demo; tables = run_demo(device="cpu", epochs=2)
"""

from __future__ import annotations

import importlib
import time
import traceback
from collections.abc import Callable, Sequence

import torch

from overdrive._utils.device import resolve_device
from overdrive._utils.errors import MissingDependencyError, UsageError
from overdrive.amp.config import OPT_LEVELS, parse_dtype
from overdrive.demo.context import DemoContext, StageSkipped
from overdrive.recipes.data import load_digits
from overdrive._utils.table import Table
from overdrive.demo.workloads import choose_workload

# Stage name -> module (each has ``run(ctx) -> Table | list[Table]``), in the order they run.
STAGES: dict[str, str] = {
    "amp": "overdrive.demo.amp_stage",
    "quant": "overdrive.demo.quant_stage",
    "sparsity": "overdrive.demo.sparsity_stage",
    "engine": "overdrive.demo.engine_stage",
    "transformer": "overdrive.demo.transformer_stage",
    "data": "overdrive.demo.data_stage",
    "distributed": "overdrive.demo.distributed_stage",
}
# Stages that bring their own model: run alone, they need no O0-trained digits model from amp first. The others
# (quant, sparsity, engine) start from it: run without amp, amp runs first at O0 only and its table says why.
STANDALONE: frozenset[str] = frozenset({"transformer", "data", "distributed"})
# The run_demo settings (by their CLI flag) each stage trains or measures with; the others have no effect on it.
# The amp stage run first for quant/sparsity/engine trains at O0 in fp32: it uses --epochs and --batch-size only.
USES: dict[str, frozenset[str]] = {
    "amp": frozenset({"--opt-level", "--dtype", "--epochs", "--batch-size"}),
    "quant": frozenset({"--epochs", "--batch-size"}),  # QAT epochs, calibration and fine-tune batches
    "sparsity": frozenset({"--batch-size"}),  # its fine-tune has fixed epochs
    "engine": frozenset(),  # inference at the workload's serving batch
    "transformer": frozenset(),  # its own model and shapes
    "data": frozenset({"--epochs", "--batch-size"}),  # --batch-size with --quick only (else the digits CNN's 64)
    "distributed": frozenset(),  # a fixed global batch and epochs, the same for every strategy
}


def run_demo(
    device: str = "auto",
    opt_levels: Sequence[str] | None = None,
    epochs: int | None = None,
    batch_size: int | None = None,
    dtype: str | torch.dtype | None = None,
    stages: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = True,
    on_table: Callable[[Table], None] | None = None,
    quick: bool = False,
    verbose: bool = False,
) -> list[Table]:
    """Run the demo's stages and return their tables (``on_table`` sees each as it is ready).

    Stages run in :data:`STAGES`' order, each once. No stage ends the demo: one that cannot run here
    (:class:`StageSkipped`, a missing optional package) gives a table with status "skipped", one that breaks
    gives a table with status "failed" and the error; the stages after it still run (those that start from the amp
    stage's O0 model, when amp failed, are skipped and say so). Ctrl-C does end it:
    ``on_table`` then gets an "interrupted" table for the stage it stopped, and KeyboardInterrupt goes on up. ``quick`` trains the tiny digits CNN (seconds); otherwise the workload
    is sized for the device (:func:`overdrive.demo.workloads.choose_workload`).
    ``opt_levels`` None is every level (O0-O3). A setting that none of the chosen stages uses (``opt_levels`` or
    ``dtype`` without the amp stage, ``epochs`` with only the transformer stage...) is refused before any work.
    """
    dev = resolve_device(device)
    given = {"--opt-level": opt_levels is not None and any(lvl != "O0" for lvl in opt_levels),
             "--dtype": dtype is not None, "--epochs": epochs is not None, "--batch-size": batch_size is not None}
    opt_levels = OPT_LEVELS if opt_levels is None else tuple(opt_levels)
    for lvl in opt_levels:
        if lvl not in OPT_LEVELS:
            raise UsageError(f"opt level {lvl!r} is not one of {', '.join(OPT_LEVELS)}")
    if "O0" not in opt_levels:
        opt_levels = ("O0", *opt_levels)  # the baseline every other row is compared with
    # torch's generators take 64 bits (the stages add small offsets to the seed): a bigger one failed on "Overflow
    # when unpacking long long" once the set-up had run
    if not -2**63 <= seed < 2**63:
        raise UsageError(f"--seed {seed} does not fit torch's 64-bit generator; use a seed from {-2**63} to "
                         f"{2**63 - 1}, such as 0")
    if epochs is not None and epochs < 1:
        raise UsageError(f"--epochs {epochs} must be >= 1")
    if batch_size is not None and batch_size < 2:
        raise UsageError(f"--batch-size {batch_size} must be >= 2 (BatchNorm needs two samples)")
    half = parse_dtype(dtype) or (torch.float16 if dev.type == "cuda" else torch.bfloat16)
    if half == torch.float16 and dev.type == "cpu":
        raise UsageError("--dtype fp16 on the CPU: torch's CPU autocast runs bf16; use --dtype bf16, or --device cuda")
    unknown = [s for s in stages or () if s not in STAGES]
    if unknown:
        raise UsageError(f"unknown demo stage(s) {unknown}; choose from {list(STAGES)}")
    # STAGES' order, each once, however they were given: `--stage quant --stage amp` ran quant first, before the
    # amp model it starts from existed (a failed stage), and a repeated name ran its stage twice
    chosen = [s for s in STAGES if not stages or s in stages]
    needs_model = [s for s in chosen if s not in STANDALONE and s != "amp"]
    prerequisite = "amp" not in chosen and bool(needs_model)
    _refuse_unused(given, chosen, prerequisite, quick)
    if prerequisite:  # they start from the O0-trained model: train that one, not every opt level
        chosen = ["amp", *chosen]
        opt_levels = ("O0",)
    workload = choose_workload(dev, quick, batch_size, epochs)
    digits = load_digits(seed=seed)
    n_train = len(digits.y_train)
    if workload.batch_size > n_train:  # every training batch is a full one (drop_last): none would be left
        raise UsageError(f"--batch-size {workload.batch_size} is more than the {n_train} training images; "
                         f"use at most {n_train}")
    ctx = DemoContext(device=dev, dtype=half, digits=digits, epochs=workload.epochs,
                      batch_size=workload.batch_size, seed=seed, opt_levels=tuple(opt_levels), progress=progress,
                      workload=workload)
    tables: list[Table] = []
    amp_failed = False
    for name in chosen:
        t0 = time.perf_counter()
        try:
            if amp_failed and name not in STANDALONE:  # it starts from amp's O0 model: there is none to start from
                raise StageSkipped("the 'amp' stage, whose O0-trained fp32 model this stage starts from, failed "
                                   "(its table says why); fix that and run again")
            out = importlib.import_module(STAGES[name]).run(ctx)
            produced = out if isinstance(out, list) else [out]
        except (StageSkipped, MissingDependencyError) as exc:
            produced = [_status_table(name, "skipped", str(exc))]
        except KeyboardInterrupt:  # Ctrl-C ends the demo; on_table hears which stage it stopped, so the
            if on_table is not None:  # caller can keep what the finished stages measured
                on_table(_status_table(name, "interrupted", "Ctrl-C during this stage; the stages after it did not run"))
            raise
        except Exception as exc:  # noqa: BLE001 - one broken stage must not hide the others' results
            if verbose:
                traceback.print_exc()
            produced = [_status_table(name, "failed", f"{type(exc).__name__}: {exc}")]
            amp_failed = amp_failed or name == "amp"
        for k, table in enumerate(produced):
            table.stage = table.stage or name
            if prerequisite and name == "amp":
                table.notes.append(f"stage 'amp' ran first, at O0 only: {', '.join(needs_model)} start(s) from its "
                                   "fp32 model; --stage amp trains and times every opt level")
            if k == len(produced) - 1:  # once per stage, under its last table (the data stage has two)
                table.notes.append(f"stage '{name}' took {time.perf_counter() - t0:.1f} s")
            tables.append(table)
            if on_table is not None:
                on_table(table)
    return tables


def _refuse_unused(given: dict[str, bool], chosen: Sequence[str], prerequisite: bool, quick: bool) -> None:
    """Refuse a setting that was given but that none of the ``chosen`` stages uses: ``--stage quant --opt-level O2``
    ran amp at O0 only and ``--stage transformer --epochs 20`` trained nothing, each without a word.

    Example:
        >>> _refuse_unused({"--dtype": True}, ["engine"], prerequisite=True, quick=True)
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: --dtype has no effect on stage(s) engine: only amp uses it; add --stage amp, or leave --dtype out
    """
    used: set[str] = set()
    for name in chosen:
        used |= USES[name] - ({"--batch-size"} if name == "data" and not quick else set())
    if prerequisite:  # the amp stage that quant/sparsity/engine start from: O0, fp32
        used |= {"--epochs", "--batch-size"}
    unused = [flag for flag, on in given.items() if on and flag not in used]
    if unused:
        users = sorted({s for flag in unused for s in STAGES if flag in USES[s]}, key=list(STAGES).index)
        add = f"--stage {users[0]}" if len(users) == 1 else f"one of {', '.join(users)} with --stage"
        raise UsageError(f"{' and '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect on stage(s) "
                         f"{', '.join(chosen)}: only {', '.join(users)} use{'s' if len(users) == 1 else ''} "
                         f"{'it' if len(unused) == 1 else 'them'}; add "
                         f"{add}, or leave {' and '.join(unused)} out")


def _status_table(stage: str, status: str, why: str) -> Table:
    first = why.strip().splitlines()[0] if why.strip() else "(no message)"
    return Table(f"Stage '{stage}': {status}", ["stage", "status", "why"], [[stage, status, first[:300]]],
                 stage=stage, status=status)


def summary(tables: Sequence[Table]) -> tuple[str, bool]:
    """The demo's last line and whether any stage failed (a skipped stage is not a failure).

    Example:
        >>> summary([Table("a", [], stage="amp"), Table("b", [], stage="data", status="skipped")])
        ('demo: 1 of 2 stage(s) ran; skipped: data', False)
    """
    stages = list(dict.fromkeys(t.stage for t in tables))
    failed = list(dict.fromkeys(t.stage for t in tables if t.status == "failed"))
    stopped = list(dict.fromkeys(t.stage for t in tables if t.status == "interrupted" and t.stage not in failed))
    skipped = list(dict.fromkeys(t.stage for t in tables if t.status == "skipped" and t.stage not in failed + stopped))
    ran = [s for s in stages if s not in failed and s not in skipped and s not in stopped]
    line = f"demo: {len(ran)} of {len(stages)} stage(s) ran"
    if failed:
        line += f"; failed: {', '.join(failed)}"
    if stopped:
        line += f"; interrupted: {', '.join(stopped)}"
    if skipped:
        line += f"; skipped: {', '.join(skipped)}"
    return line, bool(failed)


__all__ = ["run_demo", "summary", "STAGES", "DemoContext", "StageSkipped", "Table"]
