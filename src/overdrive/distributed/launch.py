"""``overdrive launch``: torchrun (torch.distributed.run) with the doctor's quick checks first.

Example:
    >>> cfg = LaunchConfig(nproc_per_node=2, max_restarts=1)
    >>> build_command(cfg, "train.py", ["--epochs", "3"])[3:7]
    ['--nnodes', '1', '--nproc-per-node', '2']
"""

from __future__ import annotations

import codecs
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.files import require_file
from overdrive.distributed.config import LaunchConfig
from overdrive.distributed import doctor


def build_command(cfg: LaunchConfig, script: str, script_args: list[str], module: bool = False,
                  log_dir: str | None = None) -> list[str]:
    """The torchrun command line: ``python -m torch.distributed.run <flags> [-m] script args``; ``log_dir`` is
    torchrun's ``--log-dir`` (without it torchrun makes a ``torchelastic_*`` folder in the temp folder per run
    and never removes it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *cfg.torchrun_args()]
    if log_dir is not None:
        cmd += ["--log-dir", log_dir]
    if module:
        cmd.append("-m")
    return [*cmd, script, *script_args]


def _gpus_for_ranks(env: dict[str, str]) -> int:
    """How many GPUs the ranks will see: ``CUDA_VISIBLE_DEVICES`` of the environment they get ("" hides
    every GPU: CPU ranks on a GPU machine), else every GPU of this machine.

    Example:
        >>> _gpus_for_ranks({"CUDA_VISIBLE_DEVICES": ""})
        0
    """
    import torch

    if "CUDA_VISIBLE_DEVICES" in env:
        listed = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"]
        return min(len(listed), torch.cuda.device_count()) if torch.cuda.is_available() else 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


MASTER_WAIT_S = 300.0  # how long a node other than 0 waits for node 0's port before the launch stops


def preflight(cfg: LaunchConfig, env: dict[str, str] | None = None, master_wait_s: float = MASTER_WAIT_S) -> dict[str, Any]:
    """The doctor's quick checks for this launch (no bandwidth test); raises on an error finding.

    On a node other than 0, a master port nothing listens on yet is waited for, up to ``master_wait_s``: nodes of one
    job start in any order (``srun``, ``pdsh``), and torchrun's ranks wait for node 0 too. Refused at once, a node
    that came up a second before node 0 stopped the whole job.
    """
    env = dict(os.environ if env is None else env)
    import torch

    visible = _gpus_for_ranks(env)
    if isinstance(cfg.nproc_per_node, int) and visible and cfg.nproc_per_node > visible:
        raise OverdriveError(f"--nproc-per-node {cfg.nproc_per_node} but {visible} GPU(s) are visible; "
                             "lower it or check CUDA_VISIBLE_DEVICES")
    if cfg.rdzv_endpoint is not None:
        host, port = cfg.rdzv_endpoint.rsplit(":", 1)
        addr, prt = host, int(port)
    else:
        addr, prt = cfg.master_addr, cfg.master_port or (29500 if cfg.master_addr else None)
    # torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_PORT in every rank: stale ones here do not matter
    env = {k: v for k, v in env.items() if k not in doctor.RANK_VARS}
    if cfg.standalone:  # torchrun picks its own free port; a stale MASTER_ADDR does not matter either
        addr = prt = None
        env = {k: v for k, v in env.items() if k != "MASTER_ADDR"}
    # only a node other than 0 waits: node 0 opens the port itself (with c10d rendezvous, whichever node comes first
    # hosts the store, and node 0's port findings are dropped below)
    wait = master_wait_s if cfg.node_rank > 0 else 0.0

    def say_waiting() -> None:
        print(f"overdrive launch: nothing listens on {addr}:{prt} yet; waiting up to {wait:g} s for node 0's launch",
              file=sys.stderr, flush=True)

    report = doctor.diagnose(master_addr=addr, master_port=prt, node_rank=cfg.node_rank, env=env, topology=False,
                             master_wait_s=wait, on_wait=say_waiting)
    if cfg.rdzv_endpoint is not None:
        # c10d rendezvous: whichever node comes first hosts the store; a busy port on us is fine.
        report["findings"] = [f for f in report["findings"] if not (f["what"] == "MASTER_PORT" and cfg.node_rank == 0)]
    if not visible:  # the ranks get no GPU and join with gloo, which does not read the NCCL_* variables
        for f in report["findings"]:
            if f["level"] == "error" and f["what"].startswith("NCCL_"):
                f["level"] = "warning"
                f["detail"] += (" (not stopping this launch: no GPU is visible to its ranks, which join with gloo and "
                                "do not read it; fix it before a GPU run)")
                warnings.warn(f"overdrive launch: {f['what']}: {f['detail']}", RuntimeWarning, stacklevel=3)
                f["warned"] = True
    for f in report["findings"]:  # NCCL variable warnings (a misspelt name does nothing): said before the ranks start
        if f["level"] == "warning" and f["what"].startswith(("NCCL_", "TORCH_NCCL_")) and not f.get("warned"):
            warnings.warn(f"overdrive launch: {f['what']}: {f['detail']}", RuntimeWarning, stacklevel=3)
    errs = doctor.errors(report)
    if errs:
        raise OverdriveError("overdrive launch stopped before torchrun, the doctor found:\n  " + "\n  ".join(errs))
    return report


def check_module(name: str, env: dict[str, str] | None = None) -> None:
    """Refuse a ``-m`` module whose top-level package no rank could import: each rank runs ``python -m name`` from
    this folder, so it searches the current folder, ``PYTHONPATH`` and the interpreter's paths. Only the top level is
    looked up (nothing is imported or run here); a typo there failed in every rank, after their start.

    Example:
        >>> check_module("json")  # the standard library: found
    """
    import importlib.machinery
    import importlib.util

    env = dict(os.environ if env is None else env)
    top = name.split(".")[0]
    if name.endswith(".py") or not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(f"-m {name!r} is not a module name (dotted Python identifiers, e.g. mypkg.train); for a "
                         "file, drop -m and give its path")
    paths = [os.getcwd(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *sys.path]
    if top in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(top, paths) is not None:
        return
    raise UsageError(f"-m {name}: no module or package {top!r} in this folder ({os.getcwd()}), PYTHONPATH or the "
                     f"installed packages, so every rank would fail to start; check the name, run from the folder "
                     f"that holds {top!r}, or add its parent folder to PYTHONPATH")


def launch(cfg: LaunchConfig, script: str, script_args: list[str] | None = None, module: bool = False,
           check: bool = True, env: dict[str, str] | None = None, timeout_s: float | None = None) -> int:
    """Run ``script`` under torchrun; returns its exit code.

    Restarts (``max_restarts``): on one node (``--standalone``) overdrive runs them itself, one fresh torchrun per
    attempt (a new port and store), so scripts that join with a plain ``dist.init_process_group()`` restart too
    (under torchrun's own restarts they re-read the dead attempt's addresses: gloo's "Connection refused");
    ``TORCHELASTIC_RESTART_COUNT`` reads the attempt number in the ranks as under torchrun. Across nodes the
    restarts are torchrun's ``--max-restarts``, which need the script to join with
    :func:`overdrive.distributed.init` (one store prefix per attempt).

    torchrun's own files (its per-run log folder, the ranks' error files) go in a temporary folder that is
    removed when it exits, so runs leave no ``torchelastic_*`` folders behind.

    ``timeout_s`` bounds the whole run, restarts included: past it, torchrun is told to stop (SIGTERM, on which
    it stops every rank it started) and :class:`OverdriveError` says so; a rank hung in a collective or at exit
    then cannot hold the caller forever.

    Example:
        >>> # launch(LaunchConfig(nproc_per_node=2, max_restarts=1), "train.py", ["--steps", "100"])
    """
    if cfg.nproc_per_node == "gpu":
        import torch

        if not torch.cuda.is_available():  # torchrun would die with a traceback ("Cuda is not available.")
            raise UsageError("--nproc-per-node gpu starts one rank per GPU, but no CUDA GPU is visible here; give a "
                             "number of ranks instead (e.g. --nproc-per-node 2: CPU ranks on gloo)")
    if not module:
        require_file(script, "training script")
    env = dict(os.environ if env is None else env)
    if module:
        check_module(script, env)
    if timeout_s is not None and not timeout_s > 0:
        raise UsageError(f"launch timeout_s={timeout_s!r}: expected a positive number of seconds, or None for no limit")
    if check:
        preflight(cfg, env)
    if cfg.standalone and cfg.max_restarts > 0:
        return _restarting(cfg, script, list(script_args or []), module, env, timeout_s)
    with tempfile.TemporaryDirectory(prefix="overdrive_launch_") as log_dir:
        cmd = build_command(cfg, script, list(script_args or []), module, log_dir=log_dir)
        return _run(cmd, env, timeout_s)


def _restarting(cfg: LaunchConfig, script: str, script_args: list[str], module: bool, env: dict[str, str],
                timeout_s: float | None) -> int:
    """Up to ``cfg.max_restarts`` + 1 fresh torchrun attempts on this node, each every rank anew, within one
    ``timeout_s`` for them all; the first that exits 0 ends it, else the last attempt's exit code."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    once = cfg.replace(max_restarts=0)
    target = ["-m", script] if module else [script]
    rc = 1
    for attempt in range(cfg.max_restarts + 1):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise OverdriveError(f"the launched job ran past timeout_s={timeout_s:g} s (after {attempt} attempt(s)) and "
                                 "was stopped; a rank may be stuck in a collective: rerun with "
                                 "TORCH_DISTRIBUTED_DEBUG=DETAIL, or raise the limit")
        run_env = {**env, "OVERDRIVE_RESTART_COUNT": str(attempt), "OVERDRIVE_MAX_RESTARTS": str(cfg.max_restarts)}
        with tempfile.TemporaryDirectory(prefix="overdrive_launch_") as log_dir:
            cmd = build_command(once, "overdrive.distributed._attempt", [*target, *script_args], module=True,
                                log_dir=log_dir)
            rc = _run(cmd, run_env, left if left is None else max(left, 1e-3))
        if rc == 0:
            return 0
        if attempt < cfg.max_restarts:
            print(f"overdrive launch: attempt {attempt} exited with code {rc}; restarting every rank "
                  f"({cfg.max_restarts - attempt} restart(s) left)", file=sys.stderr, flush=True)
    return rc


class Interrupted(KeyboardInterrupt):
    """The launch was stopped by SIGINT (Ctrl-C) or SIGTERM (``kill``, a scheduler's cancel) after every rank was;
    a ``KeyboardInterrupt``, so callers that end on Ctrl-C (the CLI: one line, exit 130) end on either."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _stop_signals() -> Iterator[bool]:
    """SIGINT and SIGTERM raise :class:`Interrupted` for the block (then restored), so the launcher stops torchrun
    and its ranks before it exits: by default SIGTERM killed the launcher alone and left them running. Yields
    whether it could (only the main thread may set signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return

    def stop(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield True
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _pump(src: int, quiet: threading.Event) -> None:
    """Copy the job's stderr (torchrun's and every rank's) to ours as it comes, until ``quiet`` is set: after the
    launch is stopped the ranks' ``KeyboardInterrupt`` tracebacks and torchrun's own (``SignalException``) say
    nothing the one line about the stop does not; before it, a rank's own error shows as it always did."""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        try:
            chunk = os.read(src, 65536)
        except OSError:  # a pty reads EIO once every writer closed it: the end
            chunk = b""
        if not chunk:
            break
        if not quiet.is_set():
            try:
                sys.stderr.write(decode.decode(chunk))
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr closed: keep draining so no rank blocks on a full pipe
                pass
    os.close(src)


def _stderr_channel() -> tuple[int, int]:
    """(the job's stderr, our end to read it): a pseudo-terminal when our stderr is a terminal, so the ranks still
    see one (progress bars, colours), else a pipe."""
    try:
        if sys.stderr.isatty():
            import fcntl
            import pty
            import termios

            ours, theirs = pty.openpty()
            try:  # the terminal's size, or ranks that ask for it would get 0 columns
                fcntl.ioctl(theirs, termios.TIOCSWINSZ, fcntl.ioctl(sys.stderr.fileno(), termios.TIOCGWINSZ, b"\0" * 8))
            except OSError:
                pass
            return theirs, ours
    except (AttributeError, ValueError, OSError, ImportError):  # a replaced stderr, or no ptys (Windows)
        pass
    ours, theirs = os.pipe()
    return theirs, ours


def _run(cmd: list[str], env: dict[str, str], timeout_s: float | None) -> int:
    """Run torchrun in a session of its own and wait for it; SIGINT / SIGTERM (and ``timeout_s``) reach it from
    here, quietly: torchrun passes the signal to its ranks and waits for them (SIGKILL after its shutdown timeout),
    then exits. The launcher exits after it, so no rank is left running."""
    with _stop_signals() as own:
        theirs, ours = _stderr_channel()
        try:
            # its own group when we forward the signals: a terminal's Ctrl-C reaches the launcher alone
            proc = subprocess.Popen(cmd, env=env, stderr=theirs, start_new_session=own)
        except BaseException:
            os.close(ours)
            raise
        finally:
            os.close(theirs)
        quiet = threading.Event()
        pump = threading.Thread(target=_pump, args=(ours, quiet), name="overdrive-launch-stderr", daemon=True)
        pump.start()
        try:
            return proc.wait(timeout=timeout_s)
        except KeyboardInterrupt as exc:
            quiet.set()
            proc.send_signal(exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)
            _reap(proc)
            raise
        except subprocess.TimeoutExpired:
            quiet.set()
            proc.terminate()  # torchrun stops its ranks on SIGTERM (each runs in a session of its own)
            _reap(proc)
            raise OverdriveError(f"the launched job ran past timeout_s={timeout_s:g} s and was stopped with every "
                                 "rank; a rank may be stuck in a collective: rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL, "
                                 "or raise the limit") from None
        finally:
            if proc.poll() is None:  # any other way out of the wait: nothing of the job may outlive it
                quiet.set()
                proc.terminate()
                _reap(proc)
            pump.join()


def _reap(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Wait for torchrun to stop its ranks and exit (it SIGKILLs them after its 30 s shutdown timeout); past
    ``grace_s``, kill its process group. A second Ctrl-C meanwhile does not cut the wait short: leaving now would
    leave the ranks running."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            return
        except KeyboardInterrupt:
            continue
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()
            return


def _warn_oversubscribed(nproc: int, backend: str | None) -> None:
    """Warn, before the test starts, when CPU ranks outnumber the usable cores: each gets a slice of a core, the run
    takes minutes and its bandwidths measure the oversubscription (64 ranks on 2 cores took 152 s)."""
    import torch

    from overdrive.data.config import usable_cpus

    cores = usable_cpus()
    cpu_ranks = backend == "gloo" or not torch.cuda.is_available()
    if cpu_ranks and nproc > cores:
        warnings.warn(f"--bandwidth {nproc} starts {nproc} CPU ranks on {cores} usable core(s): expect minutes, and "
                      "bandwidths that measure the oversubscription rather than the interconnect; "
                      f"--bandwidth {cores} gives one rank per core", UserWarning, stacklevel=3)


def bandwidth(nproc: int, min_bytes: int = 8 * 1024, max_bytes: int = 64 * 2**20, ops: str = "all_reduce,all_gather,reduce_scatter",
              iters: int = 20, backend: str | None = None) -> dict[str, Any]:
    """Run the collective bandwidth test on ``nproc`` local ranks (torchrun, standalone).

    The options are checked here first: a bad one is one clear error, not a traceback from every rank."""
    from overdrive.distributed.bandwidth import OPS

    if nproc < 1:
        raise UsageError(f"--bandwidth {nproc}: give the number of local ranks to test (>= 1), or leave it out")
    bad = [o for o in ops.split(",") if o not in OPS]
    if bad:
        raise UsageError(f"--ops {ops}: unknown collective(s) {bad}; choose from {', '.join(OPS)}")
    if not 1 <= min_bytes <= max_bytes:
        raise UsageError(f"--min-bytes {min_bytes} --max-bytes {max_bytes}: need 1 <= --min-bytes <= --max-bytes")
    _warn_oversubscribed(nproc, backend)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bw.json")
        args = ["--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes), "--ops", ops, "--iters", str(iters), "--out", out]
        if backend:
            args += ["--backend", backend]
        rc = launch(LaunchConfig(nproc_per_node=nproc), "overdrive.distributed.bandwidth", args, module=True, check=False)
        if rc != 0 or not os.path.exists(out):
            raise OverdriveError(f"the bandwidth test failed (torchrun exit code {rc}); rerun with NCCL_DEBUG=WARN to see why")
        return json.loads(Path(out).read_text())
