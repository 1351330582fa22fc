"""Ranks from Slurm's ``srun`` (no torchrun): rank, size, master address and port from a job step's variables.

``srun -N 2 --ntasks-per-node 4 python train.py`` starts 8 tasks of one job step; each gets SLURM_PROCID (0-7),
SLURM_STEP_NUM_TASKS (8), SLURM_LOCALID, SLURM_STEP_NODELIST and SLURM_STEP_ID. The batch script of ``sbatch``
(Slurm's "batch" step: one process on the first node) gets SLURM_PROCID=0 and SLURM_NTASKS of the whole job but no
SLURM_STEP_NUM_TASKS, and an ``salloc`` shell gets no step at all. So only SLURM_STEP_NUM_TASKS > 1 says that srun
started several processes of this program; SLURM_NTASKS alone would make ``python train.py`` in a batch script wait
for peers that never come.

Example:
    >>> expand_hostlist("gpu[01-03,07],cpu5")
    ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5']
"""

from __future__ import annotations

import itertools

from overdrive._utils.errors import UsageError

LAUNCHER = "srun (Slurm)"
SPECIAL_STEPS = 0xFFFFFFF0  # step ids from here up are Slurm's own (batch 0xFFFFFFFB, extern 0xFFFFFFFC, interactive)


def _split_top(expr: str) -> list[str]:
    """``expr`` split at the commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError("'[' without ']'")
    parts.append("".join(cur))
    return parts


def _range(spec: str) -> list[str]:
    """The values of one bracket's list, zero padding kept: "01-03,7" -> ["01", "02", "03", "7"]."""
    out: list[str] = []
    for item in spec.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{item!r} is not a number or a range lo-hi")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0  # "01-10" -> 01..10; "8-10" -> 8, 9, 10
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(expr: str) -> list[str]:
    """The host names of a Slurm host list, in order: "gpu[01-04,07]" -> gpu01 ... gpu04, gpu07; several bracket
    groups in one name expand as a product ("r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2), as ``scontrol show hostnames``.

    Example:
        >>> expand_hostlist("n[8-10]")
        ['n8', 'n9', 'n10']
    """
    hosts: list[str] = []
    try:
        for part in _split_top(expr.strip()):
            part = part.strip()
            if not part:
                continue
            # "r[1-2]n[3]" -> literal pieces and bracket lists: ["r"], ["1", "2"], ["n"], ["3"]
            pieces: list[list[str]] = []
            rest = part
            while "[" in rest:
                head, _, tail = rest.partition("[")
                spec, close, rest = tail.partition("]")
                if not close:
                    raise ValueError("'[' without ']'")
                pieces += [[head], _range(spec)]
            if "]" in rest:
                raise ValueError("']' without '['")
            pieces.append([rest])
            hosts += ["".join(p) for p in itertools.product(*pieces)]
    except ValueError as exc:
        raise UsageError(f"Slurm host list {expr!r} cannot be read ({exc}); expected names like "
                         "'gpu[01-04,07],cpu5'; export MASTER_ADDR=<the first node's address> before srun") from exc
    if not hosts:
        raise UsageError(f"Slurm host list {expr!r} names no host; export MASTER_ADDR=<the first node's address> "
                         "before srun")
    return hosts


def _int(environ: dict[str, str], var: str) -> int | None:
    value = environ.get(var, "").strip()
    return int(value) if value.isdigit() else None


def default_port(environ: dict[str, str]) -> int | None:
    """The master port every task of a step derives alike: the first of the step's reserved ports
    (SLURM_STEP_RESV_PORTS, ``srun --resv-ports``) if Slurm gave any, else
    15000 + 15 * (SLURM_JOB_ID mod 1000) + (SLURM_STEP_ID mod 15), in 15000-29999, below Linux's ephemeral ports:
    two jobs whose ids differ by less than 1000 differ, and so do a job's first 15 steps. None without a job id.

    Example:
        >>> default_port({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"})
        18631
    """
    resv = environ.get("SLURM_STEP_RESV_PORTS", "").strip()
    first = resv.split(",")[0].split("-")[0]
    if first.isdigit() and 0 < int(first) < 65536:
        return int(first)
    job, step = _int(environ, "SLURM_JOB_ID"), _int(environ, "SLURM_STEP_ID") or 0
    return None if job is None else 15000 + 15 * (job % 1000) + step % 15


def step_env(environ: dict[str, str]) -> dict[str, str] | None:
    """RANK / WORLD_SIZE, and MASTER_ADDR / MASTER_PORT where unset, of a task that ``srun`` started as one of
    several in its job step; None anywhere else (the batch script, an ``salloc`` shell, a step of one task).
    MASTER_ADDR is the step's first node (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), where Slurm's block and
    cyclic distributions place task 0; MASTER_PORT is :func:`default_port`.

    Example:
        >>> env = step_env({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_ID": "0",
        ...                 "SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[01-02]"})
        >>> env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["MASTER_PORT"]
        ('3', '8', 'gpu01', '16155')
    """
    n = _int(environ, "SLURM_STEP_NUM_TASKS")
    if n is None or n < 2 or "SLURM_PROCID" not in environ:
        return None
    step = _int(environ, "SLURM_STEP_ID")
    if step is not None and step >= SPECIAL_STEPS:  # the batch, extern or interactive step: one process, not srun's
        return None
    out = {"RANK": environ["SLURM_PROCID"].strip(), "WORLD_SIZE": str(n)}
    if not environ.get("MASTER_ADDR", "").strip():
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if nodes:
            out["MASTER_ADDR"] = expand_hostlist(nodes)[0]
    if not environ.get("MASTER_PORT", "").strip():
        port = default_port(environ)
        if port is not None:
            out["MASTER_PORT"] = str(port)
    return out


def check_master_host(environ: dict[str, str]) -> None:
    """Raise a :class:`UsageError` on task 0 when it runs on another node (SLURMD_NODENAME) than the MASTER_ADDR that
    :func:`step_env` took from the node list, as under ``--distribution=arbitrary``: the store would open where no
    peer looks for it, and every task would wait out its timeout."""
    here = environ.get("SLURMD_NODENAME", "").strip()
    addr = environ.get("MASTER_ADDR", "")
    if environ.get("RANK") == "0" and here and here != addr:
        raise UsageError(f"srun placed task 0 on {here}, not on the step's first node {addr} (from "
                         "SLURM_STEP_NODELIST), where the other tasks look for it; export MASTER_ADDR=<task 0's node> "
                         "before srun, or use the default block distribution")
