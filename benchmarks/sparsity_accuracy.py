"""Accuracy of 2:4 sparsity on CPU: dense vs pruned (no fine-tune) vs pruned + fine-tuned with the
same schedule, with and without channel permutation, on two real tasks that need no download:

- digits: the demo's DigitsCNN on scikit-learn's 8x8 handwritten digits (conv/BN/residual);
- docstrings: a 2-layer byte-level transformer classifying 64-byte docstring chunks by the standard
  library module they come from (12 modules, text shipped with Python).

    PYTHONPATH=src python benchmarks/sparsity_accuracy.py           # full (~several minutes on 2 cores)
    PYTHONPATH=src python benchmarks/sparsity_accuracy.py --quick   # fewer epochs (< 60 s)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))

from overdrive.recipes.sparsity import prune_and_finetune, train  # noqa: E402

sys.path.insert(0, str(ROOT))
from _common import device_facts, write_results  # noqa: E402


def digits_task(seed: int):
    from overdrive.recipes.data import load_digits
    from overdrive.recipes.models import DigitsCNN

    d = load_digits(seed=seed)
    tr, te = d.loaders(batch_size=64, seed=seed)
    return DigitsCNN, tr, te, 3e-3


def docstring_task(seed: int, limit: int | None = None):
    from overdrive.recipes.textdata import ByteTransformer, load_docstring_task

    xtr, ytr, xte, yte = load_docstring_task(seed=seed)
    if limit is not None:  # --quick: a subset, to prove the script end to end
        xtr, ytr = xtr[:limit], ytr[:limit]
    g = torch.Generator().manual_seed(seed)
    tr = DataLoader(TensorDataset(xtr, ytr), batch_size=64, shuffle=True, generator=g, drop_last=True)
    te = DataLoader(TensorDataset(xte, yte), batch_size=256)
    return ByteTransformer, tr, te, 2e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--epochs-digits", type=int, default=None)
    ap.add_argument("--epochs-text", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    device = torch.device("cpu")
    epochs = {"digits": args.epochs_digits or (1 if args.quick else 6),
              "docstrings": args.epochs_text or (1 if args.quick else 6)}
    t0 = time.perf_counter()
    tasks = []
    for name in ("digits", "docstrings"):
        if name == "digits":
            cls, tr, te, lr = digits_task(args.seed)
        else:
            cls, tr, te, lr = docstring_task(args.seed, 384 if args.quick else None)
        torch.manual_seed(args.seed)
        dense = cls().to(device)
        ts = time.perf_counter()
        dense_acc = train(dense, tr, te, epochs[name], lr, device)
        res = prune_and_finetune(dense, dense_acc, tr, te, epochs[name], lr, device, seed=args.seed)
        rows = [{k: v for k, v in r.items() if k != "handle"} for r in res.rows]
        tasks.append({"task": name, "epochs": epochs[name], "lr": lr, "dense_accuracy": dense_acc, "rows": rows,
                      "test_samples": len(te.dataset), "seconds": time.perf_counter() - ts})
        print(f"{name}: dense {dense_acc:.4f}; " + "; ".join(
            f"perm={r['permutation']}: pruned {r['pruned_accuracy']:.4f} -> fine-tuned {r['finetuned_accuracy']:.4f}"
            for r in rows), flush=True)
    meta = {**device_facts(device), "threads": torch.get_num_threads(), "seconds": time.perf_counter() - t0}
    stem = "sparsity_accuracy_quick" if args.quick else "sparsity_accuracy"
    md = ["| task | model | permutation | retained \\|w\\| | accuracy | vs dense (points) |", "|---|---|---|---|---|---|"]
    for t in tasks:
        md.append(f"| {t['task']} | dense ({t['epochs']} epochs) | - | 1.000 | {t['dense_accuracy']:.4f} | 0.00 |")
        for r in t["rows"]:
            p = "yes" if r["permutation"] else "no"
            md.append(f"| {t['task']} | 2:4 pruned, no fine-tune | {p} | {r['retained_magnitude']:.4f} | "
                      f"{r['pruned_accuracy']:.4f} | {100 * (r['pruned_accuracy'] - t['dense_accuracy']):+.2f} |")
            md.append(f"| {t['task']} | 2:4 + fine-tune (same schedule) | {p} | {r['retained_magnitude']:.4f} | "
                      f"{r['finetuned_accuracy']:.4f} | {100 * (r['finetuned_accuracy'] - t['dense_accuracy']):+.2f} |")
    notes = ["test sets: " + ", ".join(f"{t['task']} {t['test_samples']} samples" for t in tasks)
             + " (one sample is " + ", ".join(f"{100 / t['test_samples']:.2f}" for t in tasks) + " points).",
             "fine-tuning repeats the dense run's schedule (AdamW, OneCycle, same epochs and peak LR), masks held by "
             "the optimizer step hook; one seed."]
    _, mpath = write_results(stem, meta, notes=notes, body=md, extra={"tasks": tasks},
                             title=f"2:4 sparsity accuracy ({meta['device']}, torch {meta['torch']})", out_dir=args.out)
    print(mpath.read_text())


if __name__ == "__main__":
    main()
