"""The demo's ResNet-18 (digits at 224x224) trained through overdrive's Trainer in several configurations
beside the hand-written loop, in one run: where the gap between O2 + compile and hand-written comes from.

    python benchmarks/demo_amp_variants.py --device cuda

Writes benchmarks/results/demo_amp_variants.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from overdrive.demo.amp_stage import handwritten, train_digits
from overdrive.demo.context import DemoContext
from overdrive.recipes.data import load_digits
from overdrive.demo.workloads import choose_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import device_facts, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--epochs", type=int, default=6)
    args = ap.parse_args()
    dev = torch.device(args.device)
    w = choose_workload(dev, quick=False, epochs=args.epochs)
    ctx = DemoContext(device=dev, dtype=torch.float16, digits=load_digits(seed=0), epochs=w.epochs,
                      batch_size=w.batch_size, progress=False, workload=w)
    out = {}
    hand = handwritten(ctx, compile=dev.type == "cuda")
    out["hand-written"] = hand["samples_per_s"]
    for level, comp, cl in [("O2", True, True), ("O1", True, True), ("O0", True, True), ("O2", False, True)]:
        _, _, r = train_digits(ctx, level, compile=comp, channels_last=cl)
        out[f"{level} compile={comp} channels_last={cl}"] = r.samples_per_s
    for k, v in out.items():
        print(f"{k:45s} {v:10.0f} img/s  {v / out['hand-written']:.2f}x hand-written")
    rows = [{"run": k, "img_per_s": v, "vs_hand_written": v / out["hand-written"]} for k, v in out.items()]
    notes = [f"batch {w.batch_size}, fp16, {w.epochs} epochs, img/s over the epochs after the first; one run. "
             "hand-written: autocast + GradScaler, channels_last, fused AdamW and torch.compile on CUDA."]
    write_results("demo_amp_variants", {**device_facts(dev), "epochs": w.epochs}, rows,
                  ["run", "img_per_s", "vs_hand_written"], notes)


if __name__ == "__main__":
    main()
