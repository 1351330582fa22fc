"""What `--timing-cache FILE` saves on a rebuild: build time in fresh processes, each with an empty Inductor
cache folder (a new CI runner or container), without the flag, with it and no file yet (the first build
writes FILE), and again with FILE present.

    python benchmarks/engine_build_cache.py                     # CPU, the digits CNN: about 1 minute
    python benchmarks/engine_build_cache.py --device cuda --model torchvision.models:resnet50 \\
        --shape 256x3x224x224 --precision fp16                  # H200: about 2 minutes
Writes benchmarks/results/engine_build_cache[_<device>].json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, write_results  # noqa: E402

CHILD = """
import json, sys, time, torch
from overdrive.engine import Builder, ShapeProfile
from overdrive.engine.sources import from_factory
model_spec, shape, precision, device, cache = sys.argv[1:6]
dims = tuple(int(d) for d in shape.split("x"))
if model_spec == "digits":
    from overdrive.recipes.models import DigitsCNN
    torch.manual_seed(0)
    model = DigitsCNN().eval()
else:
    model = from_factory(model_spec).module
t0 = time.perf_counter()
eng = Builder(precision=precision, device=device, backend="inductor", timing_cache=cache or None, aot=False,
              profiles=[ShapeProfile.fixed("x", dims)]).build(model, (torch.randn(dims),), input_names=["x"])
build_s = time.perf_counter() - t0
meta = eng.header["backend_meta"]
from torch._dynamo.utils import counters
print(json.dumps({"fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"], "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"], "build_s": build_s, "timing_cache": eng.info["timing_cache"], "export_s": meta.get("export_s"), "compile_s": meta.get("compile_s")}))
"""


def build_in_fresh_process(args: argparse.Namespace, cache_file: str) -> dict:
    with tempfile.TemporaryDirectory() as inductor_cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache, PYTHONPATH=str(ROOT.parent / "src"))
        r = subprocess.run([sys.executable, "-c", CHILD, args.model, args.shape, args.precision, args.device, cache_file],
                           capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-1200:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="digits", help="digits, or pkg.module:factory")
    ap.add_argument("--shape", default="8x1x8x8", help="the input shape, static")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "timing.cache")
        for label, path in (("no --timing-cache [baseline]", ""), ("--timing-cache, no file yet (writes it)", cache),
                            ("--timing-cache, file present", cache)):
            r = build_in_fresh_process(args, path)
            tc = r.get("timing_cache") or {}
            rows.append({"build": label, "build_s": r["build_s"], "vs_baseline": None, "compile_s": r["compile_s"],
                         "inductor_cache_hits": r["fxgraph_cache_hit"],
                         "cache_loaded_bytes": tc.get("loaded_bytes"), "cache_saved_bytes": tc.get("saved_bytes")})
            print(rows[-1], flush=True)
    for r in rows:
        r["vs_baseline"] = r["build_s"] / rows[0]["build_s"]
    notes = [f"model {args.model}, input {args.shape}, {args.precision} on {args.device}; each build in a fresh Python "
             "process with an empty TORCHINDUCTOR_CACHE_DIR, all on the torch.compile path (aot=False: --timing-cache needs it); build_s: Builder.build only (imports excluded); "
             "vs_baseline: build time / the no-flag build's (lower is better); compile_s: the compile and first calls "
             "inside the build; inductor_cache_hits: Inductor FX-graph cache hits in that process"]
    name = args.name or ("engine_build_cache" if args.device.startswith("cuda") else "engine_build_cache_cpu")
    write_results(name, device_facts(torch.device(args.device)), rows,
                  ["build", "build_s", "vs_baseline", "compile_s", "inductor_cache_hits", "cache_loaded_bytes",
                   "cache_saved_bytes"], notes)


if __name__ == "__main__":
    main()
