"""The environment the multi-rank tests give torchrun: this checkout's src first on PYTHONPATH, so every rank
imports the overdrive under test, and one OpenMP thread per rank on CPU (two ranks share the CI's 2 cores)."""

from __future__ import annotations

import os
from pathlib import Path

SRC = Path(__file__).parents[2] / "src"


def worker_env(omp_threads: int | None = 1) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env
