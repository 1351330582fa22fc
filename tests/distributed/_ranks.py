"""Two real processes started as a launcher other than torchrun starts them (mpirun, srun): each joins through
``overdrive.distributed.init()`` on gloo and all-reduces its rank + 1, so one group of 2 sums to 3."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

RANK_SCRIPT = """
import json, torch, torch.distributed as dist
from overdrive import distributed as odist
env = odist.init(device="cpu")
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": env.rank, "world": env.world_size, "local": env.local_rank, "sum": float(t)}), flush=True)
odist.leave()
"""


def run_ranks(envs: list[dict[str, str]], timeout: float = 120) -> list[dict[str, float]]:
    """Run :data:`RANK_SCRIPT` once per environment, side by side; each process's JSON line, in ``envs`` order."""
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs
