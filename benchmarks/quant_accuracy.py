"""overdrive.quant accuracy: fp32 vs PTQ (every calibrator) vs fp8 vs partial PTQ vs QAT on
(a) the demo's digits CNN (scikit-learn digits, real 8x8 images) and
(b) a small transformer trained here on a real text task shipped with Python: which standard-library
    package (asyncio, email, unittest, xml) a line of its source code comes from. The recipe: every
    line of the package's .py files with >= 24 characters after stripping, de-duplicated, shuffled
    with a fixed seed, bytes clipped to ASCII, 64 characters; 80/20 split.

Both models are trained with overdrive.train.Trainer at O0. Runs on CPU:
    python3 benchmarks/quant_accuracy.py            # writes benchmarks/results/quant_accuracy.{json,md}
    python3 benchmarks/quant_accuracy.py --quick    # fewer epochs / lines
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from overdrive.recipes import quant as recipe  # noqa: E402
from overdrive.demo.report import Table  # noqa: E402
from overdrive.train import Trainer, evaluate  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import device_facts, write_results  # noqa: E402

PACKAGES = ("asyncio", "email", "unittest", "xml")


def stdlib_lines(max_per_class: int, seq: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    root = Path(sysconfig.get_paths()["stdlib"])
    xs, ys = [], []
    rng = random.Random(seed)
    for label, pkg in enumerate(PACKAGES):
        lines = set()
        for f in sorted((root / pkg).rglob("*.py")):
            if "test" in f.parts[-2:-1]:
                continue
            for line in f.read_text(encoding="utf-8", errors="ignore").splitlines():
                s = line.strip()
                if len(s) >= 24:
                    lines.add(s)
        chosen = sorted(lines)
        rng.shuffle(chosen)
        for s in chosen[:max_per_class]:
            b = [min(c, 127) for c in s.encode("utf-8")[:seq]]
            xs.append(b + [0] * (seq - len(b)))
            ys.append(label)
    x, y = torch.tensor(xs), torch.tensor(ys)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    return x[perm], y[perm]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hs)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LN block; its forward only calls submodules and adds, so torch.fx sees the residual adds."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class LineClassifier(nn.Module):
    """(B, T) ASCII codes -> (B, classes). Pre-LN transformer encoder, mean pooled."""

    def __init__(self, classes: int, d: int = 96, layers: int = 2, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(128, d), nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.blocks(self.emb(x) + self.pos[: x.shape[1]]))
        return self.head(h.mean(1))


def train(model: nn.Module, train_dl, test_dl, epochs: int, lr: float) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(train_dl))
    Trainer(model, opt, policy="O0", scheduler=sched, progress=False).fit(train_dl, epochs=epochs)
    return evaluate(model.eval(), test_dl)[1]


def accuracy_table(name: str, model: nn.Module, base: float, calib: list[torch.Tensor], train_dl, test_dl,
                   qat_epochs: int, qat_lr: float) -> Table:
    t, _, ranking = recipe.accuracy_table(f"{name}: fp32 vs PTQ vs partial vs QAT", model, base, calib, train_dl,
                                          test_dl, qat_epochs=qat_epochs, qat_lr=qat_lr, partial_k=2)
    t.notes.append(f"calibration: {len(calib)} training batches, one pass; every method computed from its histograms. "
                   f"Sensitivity (points lost when quantized alone): "
                   + ", ".join(f"{r['layer']} {100 * r['drop']:+.1f}" for r in ranking[:3]))
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tables = []
    # (a) digits CNN
    from overdrive.recipes.data import load_digits
    from overdrive.recipes.models import DigitsCNN

    digits = load_digits()
    torch.manual_seed(0)
    cnn = DigitsCNN()
    tr, te = digits.loaders(batch_size=64)
    base = train(cnn, tr, te, epochs=4 if args.quick else 8, lr=3e-3)
    tables.append(accuracy_table("digits CNN (scikit-learn digits, 1,438 train / 359 test)", cnn, base,
                                 digits.calibration_batches(n=8), tr, te, qat_epochs=1, qat_lr=3e-5))
    print(tables[-1].to_markdown(), flush=True)
    # (b) transformer on stdlib source lines
    x, y = stdlib_lines(max_per_class=800 if args.quick else 2500)
    n_test = len(y) // 5
    g = torch.Generator().manual_seed(0)
    tr = DataLoader(TensorDataset(x[n_test:], y[n_test:]), batch_size=64, shuffle=True, generator=g, drop_last=True)
    te = DataLoader(TensorDataset(x[:n_test], y[:n_test]), batch_size=256)
    torch.manual_seed(0)
    tf = LineClassifier(len(PACKAGES))
    epochs = 3 if args.quick else 6
    base = train(tf, tr, te, epochs=epochs, lr=2e-3)
    calib = [x[n_test + i * 64: n_test + (i + 1) * 64] for i in range(8)]
    tables.append(accuracy_table(f"transformer (2 layers, d 96) on stdlib source lines, {len(y) - n_test} train / "
                                 f"{n_test} test, 4 classes {PACKAGES}", tf, base, calib, tr, te,
                                 qat_epochs=max(1, math.ceil(epochs / 10)), qat_lr=2e-5))
    print(tables[-1].to_markdown(), flush=True)
    meta = {**device_facts(torch.device("cpu"), None if argv is None else ["benchmarks/quant_accuracy.py", *argv]),
            "seconds": round(time.perf_counter() - t0, 1)}
    stem = "quant_accuracy_quick" if args.quick else "quant_accuracy"
    write_results(stem, meta, tables=tables, title="overdrive.quant accuracy", out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
