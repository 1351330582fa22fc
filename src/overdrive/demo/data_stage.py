"""Demo stage: the digits written out as an image folder (PNG), trained through overdrive.data.ImageLoader, and
text tokenized through overdrive.data.tokenize.

Compares with the accuracy the amp stage reached from in-memory tensors (same model). One file is
corrupt on purpose: the loader skips it, warns, and counts it. The tokenization table times ``tokenize`` against
the loops a user writes with the tokenizer itself, on the same texts, and checks every text's ids against them.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from overdrive.demo.context import DemoContext
from overdrive.recipes.models import DigitsCNN
from overdrive._utils.table import Table
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


def run(ctx: DemoContext) -> list[Table]:
    """The image-pipeline table, then the tokenization table (a tokenization that breaks is its own failed table:
    the image rows stay)."""
    tables = [images_table(ctx)]
    try:
        tables.append(tokenize_table(ctx))
    except Exception as exc:  # noqa: BLE001 - as run_demo does for a stage: the error in a table, the rest kept
        tables.append(Table("Fast tokenization (overdrive.data.tokenize)", ["run", "why"],
                            [["not run", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"]],
                            stage="data", status="failed"))
    return tables


def images_table(ctx: DemoContext) -> Table:
    from overdrive.data import ImageLoader, LoaderConfig

    d = ctx.digits
    epochs = min(ctx.epochs, 3)
    quick = ctx.workload.width is None
    bs = ctx.batch_size if quick else 64  # the digits CNN's batch (the full workload's is for its ResNet)
    table = Table(f"GPU data pipeline (overdrive.data.ImageLoader) on digits as PNG files, {ctx.device.type}",
                  ["input", "test accuracy", "final train loss", "samples/s", "skipped files"])
    with tempfile.TemporaryDirectory(prefix="overdrive_digits_") as tmp:
        t0 = time.perf_counter()
        train_dir = write_digits_folder(d.x_train, d.y_train, Path(tmp) / "train")
        test_dir = write_digits_folder(d.x_test, d.y_test, Path(tmp) / "test")
        (train_dir / "3" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
        write_s = time.perf_counter() - t0
        # [0, 1] pixels like the tensors (mean 0, std 1), mild per-sample crops, no flips (digits are not symmetric)
        cfg = LoaderConfig(batch_size=bs, size=8, mean=(0, 0, 0), std=(1, 1, 1), scale=(0.8, 1.0),
                           ratio=(0.9, 1.1), flip=0.0, crop_fraction=1.0, drop_last=True, num_workers=0,
                           seed=ctx.seed, pipeline="gpu" if ctx.device.type == "cuda" else "cpu")
        train = ImageLoader(train_dir, batch_size=bs, device=ctx.device, config=cfg)
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
        # the quick demo's amp stage trained this model from the tensors; run alone (`--stage data`) there is no
        # amp stage, so the reference is trained here as the PNG run is
        from_amp = quick and ctx.fp32_accuracy is not None
        first = "tensors in memory (amp stage, O0)" if from_amp else "digits CNN, 8x8 tensors in memory (reference)"
        ref_acc = ctx.fp32_accuracy if from_amp else _tensor_reference(ctx, epochs, bs)
        rows = [[first, ref_acc, None, None, None],
                [f"PNG folder via ImageLoader ({train.pipeline} pipeline)", last.eval_accuracy, result.final_loss,
                 result.samples_per_s, train.stats.skipped]]
        table.rows = rows
    table.notes.append(f"{len(d.y_train)} train + {len(d.y_test)} test PNGs written in {write_s:.1f} s; {epochs} epochs, "
                       "per-sample RandomResizedCrop(scale 0.8-1) on the image path; one corrupt PNG skipped per epoch.")
    table.stage = "data"
    if ctx.workload.width is not None:  # the full demo: loading speed at the workload's size, against a DataLoader
        try:
            speed_rows(ctx, table)
        except RuntimeError as exc:  # a loader that timed out or whose workers died: keep the training rows above
            table.rows.append([f"loading only: not measured ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                               None, None, None, None])
            table.status = "failed"
    return table


def _tensor_reference(ctx: DemoContext, epochs: int, bs: int) -> float:
    """The digits CNN trained as the PNG run trains it (same epochs, batch, seed), from 8x8 tensors."""
    torch.manual_seed(ctx.seed)
    model = DigitsCNN().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    train, test = ctx.digits.loaders(batch_size=bs, seed=ctx.seed)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=epochs * len(train))
    trainer = Trainer(model, opt, policy="O0", device=ctx.device, scheduler=sched, progress=False)
    return trainer.fit(train, epochs=epochs, eval_data=test).history[-1].eval_accuracy


class _PilFolder(torch.utils.data.Dataset):
    """What a PyTorch user writes without overdrive: Pillow decode, a random crop + resize, to a tensor."""

    def __init__(self, files: list[Path], size: int, seed: int) -> None:
        self.files, self.size, self.seed = files, size, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import random

        import numpy as np
        from PIL import Image

        rng = random.Random(self.seed * 1_000_003 + i)
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            area = w * h * rng.uniform(0.25, 1.0)
            cw = ch = max(1, min(w, h, int(area ** 0.5)))
            x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
            im = im.resize((self.size, self.size), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
            arr = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)
        return arr.float().div_(255), int(self.files[i].parent.name)


def baseline_loader(files: list[Path], size: int, batch: int, seed: int, workers: int,
                    pin_memory: bool = False, timeout_s: float = 120.0) -> torch.utils.data.DataLoader:
    """The torch DataLoader the demo times ImageLoader against: Pillow in ``workers`` persistent worker
    processes, started as overdrive's loaders start theirs (a forkserver once CUDA is initialized: forked
    from the CUDA process, the workers hung for good on the H200), and an error, not a hang, when a batch
    takes over ``timeout_s``.

    Example:
        >>> # dl = baseline_loader(files, 224, 256, seed=0, workers=16, pin_memory=True)
    """
    from overdrive.data.loader import reader_context

    return torch.utils.data.DataLoader(_PilFolder(files, size, seed), batch_size=batch, shuffle=True,
                                       num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
                                       multiprocessing_context=reader_context() if workers > 0 else None,
                                       timeout=timeout_s if workers > 0 else 0,
                                       generator=torch.Generator().manual_seed(seed))


def speed_rows(ctx: DemoContext, table: Table) -> None:
    """Images/s of overdrive.data.ImageLoader against a torch DataLoader (Pillow, every CPU core as a
    worker) reading the same JPEG folder at the workload's size, batches delivered on the device."""
    from overdrive.data import ImageLoader, LoaderConfig
    from overdrive.data.config import usable_cpus

    size, batch = ctx.workload.image_size, ctx.workload.infer_batch
    x = ctx.data.x_train
    reps = 3 if ctx.device.type == "cuda" else 1  # enough files that an epoch outlasts the workers' start
    with tempfile.TemporaryDirectory(prefix="overdrive_jpeg_") as tmp:
        from overdrive._utils.optional import require

        Image = require("PIL.Image", extra="vision", feature="the data demo stage")
        root = Path(tmp)
        pix = (x[:, 0] * 255).round().clamp(0, 255).to(torch.uint8).numpy()
        files = []
        for r in range(reps):
            for i in range(len(pix)):
                f = root / str(int(ctx.data.y_train[i])) / f"{r}_{i:05d}.jpg"
                f.parent.mkdir(exist_ok=True)
                Image.fromarray(pix[i], mode="L").convert("RGB").save(f, quality=90)
                files.append(f)
        workers = max(1, min(16, usable_cpus()))  # the cores this process may use (its affinity mask)

        def epoch_rate(loader) -> float:  # img/s of the best of 3 epochs after a warm-up epoch
            best = 0.0
            for epoch in range(4):
                if callable(getattr(loader, "set_epoch", None)):
                    loader.set_epoch(epoch)  # new crops each epoch, as the DataLoader's
                n, t0 = 0, time.perf_counter()
                for xb, _ in loader:
                    xb = xb.to(ctx.device, non_blocking=True)
                    n += len(xb)
                torch.cuda.synchronize(ctx.device) if ctx.device.type == "cuda" else None
                best = max(best, n / (time.perf_counter() - t0))
            return best

        dl = baseline_loader(files, size, batch, ctx.seed, workers, pin_memory=ctx.device.type == "cuda")
        base = epoch_rate(dl)
        # workers kept across epochs, as the baseline keeps its DataLoader's (persistent_workers=True)
        cfg = LoaderConfig(batch_size=batch, size=size, mean=(0, 0, 0), std=(1, 1, 1), scale=(0.25, 1.0), flip=0.0,
                           seed=ctx.seed, num_workers=workers, read_workers=workers, persistent_workers=True)
        il = ImageLoader(root, batch_size=batch, device=ctx.device, config=cfg)
        try:
            ours = epoch_rate(il)
        finally:
            il.close()
    table.rows.append([f"loading only: torch DataLoader, Pillow, {workers} workers ({size}x{size} JPEG)", None, None,
                       base, None])
    table.rows.append([f"loading only: ImageLoader ({il.pipeline} pipeline)", None, None, ours, None])
    table.add_speedup(f"ImageLoader ({il.pipeline})", ours / base, "torch DataLoader + Pillow")
    table.notes.append(f"loading rows: {len(files)} JPEGs (q90) of the upscaled digits, batch {batch}, per-sample random "
                       "resized crop to the size, batches moved to the device; best of 3 epochs after a warm-up one; "
                       f"ImageLoader {ours / base:.2f}x the DataLoader.")


def tokenize_table(ctx: DemoContext, n_texts: int | None = None) -> Table:
    """Texts/s of ``overdrive.data.tokenize`` (worker processes, then its disk cache) against the two loops a user
    writes with the tokenizer alone: ``tokenizer.encode(text)`` per text (the baseline) and ``encode_batch`` (the
    tokenizers library's own threads), on the same texts in this run; every text's ids are compared with
    ``encode``'s (the accuracy: texts whose ids differ). The texts are lines of Python's standard library sources and
    the tokenizer a WordPiece one trained on them here, so nothing is downloaded.

    Example:
        >>> # tokenize_table(ctx).rows[2][3]  # tokenize's speed-up over the per-text encode loop
    """
    from overdrive._utils.errors import MissingDependencyError
    from overdrive.data import tokenize
    from overdrive.data.tokenize import default_workers, local_corpus, train_local_tokenizer

    cols = ["run", "texts/s", "tokens/s", "vs per-text encode", "vs encode_batch", "texts differing from encode",
            "seconds"]
    table = Table(f"Fast tokenization (overdrive.data.tokenize), {ctx.device.type} host", cols, stage="data")
    quick = ctx.workload.width is None
    if n_texts is None:
        n_texts = 5_000 if quick else (200_000 if ctx.device.type == "cuda" else 50_000)
    corpus = local_corpus(max_files=40 if quick else 400)
    try:
        tok = train_local_tokenizer(corpus[:20_000], vocab_size=4000 if quick else 8000)
    except MissingDependencyError as exc:
        table.status = "skipped"
        table.rows.append(["not run", None, None, None, None, None, None])
        table.notes.append(str(exc))
        return table
    texts = (corpus * (n_texts // max(len(corpus), 1) + 1))[:n_texts]
    workers = default_workers(n_texts)  # what tokenize starts with num_workers left at its default

    def timed(fn):  # (result, seconds)
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    ref, t_loop = timed(lambda: [tok.encode(t).ids for t in texts])
    n_tokens = sum(len(r) for r in ref)
    batch, t_batch = timed(lambda: [e.ids for e in tok.encode_batch(texts)])
    with tempfile.TemporaryDirectory(prefix="overdrive_tokens_") as cache:
        ours, t_ours = timed(lambda: tokenize(texts, tok, cache_dir=cache))  # num_workers: its default
        cached, t_cached = timed(lambda: tokenize(texts, tok, cache_dir=cache))

    def differing(ids_of) -> int:
        return sum(ids_of(i) != ref[i] for i in range(len(ref)))

    runs = [("tokenizer.encode(text) per text (baseline)", t_loop, 0),
            ("tokenizer.encode_batch(texts) (the tokenizers library's threads)", t_batch,
             differing(lambda i: batch[i])),
            ("overdrive.data.tokenize, " + (f"{workers} worker processes" if workers else "in this process (few texts)")
             + ", writes its cache", t_ours,
             differing(lambda i: ours[i])),
            ("overdrive.data.tokenize, the same call again (from its disk cache)", t_cached,
             differing(lambda i: cached[i]))]
    for label, secs, bad in runs:
        secs = max(secs, 1e-9)
        table.rows.append([label, n_texts / secs, n_tokens / secs, t_loop / secs, t_batch / secs, bad, secs])
    table.add_speedup(f"tokenize ({workers} processes)" if workers else "tokenize", t_loop / max(t_ours, 1e-9), "per-text encode loop",
                      0.0 if runs[2][2] == 0 else None)
    table.notes.append(
        f"{n_texts:,} texts ({n_tokens:,} tokens): lines of Python's standard library sources, repeated to that count; "
        f"a WordPiece tokenizer (vocab {tok.get_vocab_size():,}, [CLS]/[SEP] added) trained on them in this run; each "
        "run timed once, in this order, on the host's CPU cores; 'texts differing from encode': texts whose ids are "
        "not exactly tokenizer.encode(text).ids.")
    if not cached.from_cache:
        table.notes.append("the second call did not load the cache (the cache folder was not writable?)")
    return table
