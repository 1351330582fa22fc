"""Demo stage: the digits written out as an image folder (PNG), trained through overdrive.data.ImageLoader.

Compares with the accuracy the amp stage reached from in-memory tensors (same model). One file is
corrupt on purpose: the loader skips it, warns, and counts it.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from overdrive.demo.context import DemoContext
from overdrive.demo.models import DigitsCNN
from overdrive.demo.report import Table
from overdrive.train import Trainer


def write_digits_folder(x: torch.Tensor, y: torch.Tensor, root: Path) -> Path:
    """(N, 1, 8, 8) in [0, 1] -> root/<digit>/<i>.png (8-bit grayscale)."""
    from overdrive._utils.optional import require

    Image = require("PIL.Image", extra="vision", feature="the data demo stage")
    for c in range(10):
        (root / str(c)).mkdir(parents=True, exist_ok=True)
    pix = (x[:, 0] * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    for i in range(len(y)):
        Image.fromarray(pix[i], mode="L").save(root / str(int(y[i])) / f"{i:05d}.png")
    return root


class _Gray:
    """The loader's (B, 3, 8, 8) RGB batches as the (B, 1, 8, 8) the digits model takes (R=G=B here)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.loader:
            yield x[:, :1], y


def run(ctx: DemoContext) -> Table:
    from overdrive.data import ImageLoader, LoaderConfig

    d = ctx.digits
    epochs = min(ctx.epochs, 3)
    table = Table(f"GPU data pipeline (overdrive.data.ImageLoader) on digits as PNG files, {ctx.device.type}",
                  ["input", "test accuracy", "final train loss", "samples/s", "skipped files"])
    with tempfile.TemporaryDirectory(prefix="overdrive_digits_") as tmp:
        t0 = time.perf_counter()
        train_dir = write_digits_folder(d.x_train, d.y_train, Path(tmp) / "train")
        test_dir = write_digits_folder(d.x_test, d.y_test, Path(tmp) / "test")
        (train_dir / "3" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
        write_s = time.perf_counter() - t0
        # [0, 1] pixels like the tensors (mean 0, std 1), mild per-sample crops, no flips (digits are not symmetric)
        cfg = LoaderConfig(batch_size=ctx.batch_size, size=8, mean=(0, 0, 0), std=(1, 1, 1), scale=(0.8, 1.0),
                           ratio=(0.9, 1.1), flip=0.0, crop_fraction=1.0, drop_last=True, num_workers=0,
                           seed=ctx.seed, pipeline="gpu" if ctx.device.type == "cuda" else "cpu")
        train = ImageLoader(train_dir, batch_size=ctx.batch_size, device=ctx.device, config=cfg)
        test = ImageLoader(test_dir, batch_size=256, device=ctx.device, config=cfg, train=False, drop_last=False)
        torch.manual_seed(ctx.seed)
        model = DigitsCNN().to(ctx.device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=epochs * len(train))
        trainer = Trainer(model, opt, policy="O0", device=ctx.device, scheduler=sched, progress=ctx.progress)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the corrupt file's warning: counted below instead
            result = trainer.fit(_Gray(train), epochs=epochs, eval_data=_Gray(test), description="ImageLoader")
        last = result.history[-1]
        rows = [["tensors in memory (amp stage, O0)", ctx.fp32_accuracy, None, None, None],
                [f"PNG folder via ImageLoader ({train.pipeline} pipeline)", last.eval_accuracy, result.final_loss,
                 result.samples_per_s, train.stats.skipped]]
        table.rows = rows
    table.notes.append(f"{len(d.y_train)} train + {len(d.y_test)} test PNGs written in {write_s:.1f} s; {epochs} epochs, "
                       "per-sample RandomResizedCrop(scale 0.8-1) on the image path; one corrupt PNG skipped per epoch.")
    return table
