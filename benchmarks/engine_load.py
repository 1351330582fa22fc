"""How long a deployment waits for an engine: load + first call in a fresh process, inductor backend.

Builds the digits CNN (or --model pkg.module:factory) twice on this machine's device: with the stored
program + compile cache (torch.compile at load) and with an AOTInductor package. Then loads each in
fresh processes, first with an empty Inductor cache folder (a new container) and then again
with that folder kept (a restarted service).

    python benchmarks/engine_load.py            # CPU: about 2 minutes
Writes benchmarks/results/engine_load.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, write_results  # noqa: E402

CHILD = """
import sys, time, torch
t0 = time.perf_counter()
from overdrive.engine import Engine
e = Engine.load(sys.argv[1])
out = e(*e.random_inputs())
print(time.perf_counter() - t0, e.info["runtime"])
"""


def fresh_load(path: Path, cache: str) -> tuple[float, str, float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=str(ROOT.parent / "src"))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-800:])
    load_s, runtime = r.stdout.strip().splitlines()[-1].split(" ", 1)
    return float(load_s), runtime, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from overdrive.recipes.models import DigitsCNN
    from overdrive.engine import Builder, ShapeProfile

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = DigitsCNN().eval()
    x = torch.randn(8, 1, 8, 8)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="od_load_"))
    for label, aot in (("program + compile cache (torch.compile at load)", False), ("AOTInductor package", True)):
        with tempfile.TemporaryDirectory() as build_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = build_cache  # the build's own cache is not the loads'
            t0 = time.perf_counter()
            eng = Builder(precision="fp32", device=str(device), backend="inductor", aot=aot,
                          profiles=[ShapeProfile.fixed("x", (8, 1, 8, 8))]).build(model, (x,), input_names=["x"])
            build_s = time.perf_counter() - t0
            path = tmp / f"digits_{aot}.engine"
            eng.save(path)
        with tempfile.TemporaryDirectory() as cache:
            cold, runtime, cold_wall = fresh_load(path, cache)
            warm, _, warm_wall = fresh_load(path, cache)
        rows.append({"engine": label, "runtime at load": runtime, "build_s": build_s, "size_MB": path.stat().st_size / 1e6,
                     "load_s empty cache": cold, "load_s kept cache": warm, "process_s empty cache": cold_wall})
        print(rows[-1], flush=True)
    notes = ["load_s: importing overdrive.engine + Engine.load + one call, timed inside a fresh Python process after "
             "`import torch` (process_s: the whole process, interpreter and torch start included); 'empty cache': a new TORCHINDUCTOR_CACHE_DIR, 'kept cache': "
             "the same folder again.",
             f"model: the demo's digits CNN, fp32, batch 8, on {device}; torch {torch.__version__}."]
    write_results("engine_load", device_facts(device), rows,
                  ["engine", "runtime at load", "build_s", "size_MB", "load_s empty cache", "load_s kept cache",
                   "process_s empty cache"], notes)


if __name__ == "__main__":
    main()
