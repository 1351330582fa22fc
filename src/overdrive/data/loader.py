"""ImageLoader: DataLoader semantics (len, set_epoch, seeded shuffle, sharding, drop_last) over
two pipelines that compute the same transform:

- ``cpu``: worker processes (a torch DataLoader over whole batches) decode with Pillow and crop
  per sample with the reference math; pinned memory when the target is a GPU.
- ``gpu``: worker processes read each batch's file bytes and parse the JPEG headers, and hand over
  one packed buffer per batch; a decoding thread runs nvJPEG on the batch and crops, flips and
  resizes every sample in a fixed number of kernels, on a side CUDA stream, a bounded queue ahead.
  Reading in processes keeps the file I/O off this process's GIL: eight reader threads read 2.6x
  slower than one (measured on the H200 machine, benchmarks/results/data_profile.md).
"""

from __future__ import annotations

import math
import numbers
import os
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from overdrive._utils.errors import UsageError
from overdrive.data.config import DALI_OPTIONS, LoaderConfig
from overdrive.data.decode import DecodeError, decode_cpu, decode_gpu, gpu_decodable
from overdrive.data.order import rank_and_world, epoch_batches, shard_indices
from overdrive.data.sources import Sample, resolve
from overdrive.data.transforms import batch_generator, draw_params, finish, rrc_boxes, transform_batch, transform_one


@dataclass
class LoaderStats:
    """Counters for the current epoch."""

    batches: int = 0
    images: int = 0
    skipped: int = 0  # corrupt or truncated files
    cpu_fallback: int = 0  # GPU pipeline: images nvJPEG could not take (PNG, CMYK, progressive)
    skipped_files: list[str] = field(default_factory=list)


# Output sizes up to which the CPU pipeline transforms a batch with one gather-and-blend (transform_batch, the GPU
# pipeline's math, unfused) instead of image by image: per image, the half-dozen torch calls cost more than the pixels
# at small sizes. Measured on one core, batch 128-256, crop + resize + flip + normalize: S=24 7.0x faster, 32 3.2x,
# 64 1.6x; S=96 0.80x, 112 0.42x, 128 0.35x (the gather's index temporaries grow with S^2). The whole CPU loader on
# 12,000 32x32 JPEGs (2 cores): 4,008 against 3,842 img/s in-process, 7,293 against 6,675 with 2 workers; decoding
# (Pillow) is then most of the time.
BATCHED_CPU_MAX_SIZE = 64


class _BatchDataset(torch.utils.data.Dataset):
    """Item k = batch k of one epoch, decoded and transformed on the CPU (runs inside workers). With ``plan`` (the
    persistent workers' form) item (epoch, k) = batch k of that epoch, its batches computed here from the plan, so
    workers kept from one epoch to the next serve every epoch."""

    def __init__(self, samples: list[Sample], batches: list[list[int]], cfg: LoaderConfig, epoch: int,
                 plan: tuple[int, bool] | None = None) -> None:
        self.samples, self.batches, self.cfg, self.epoch = samples, batches, cfg, epoch
        self.plan = plan  # (number of samples, shuffle): with cfg, what ImageLoader._batches computes from

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        if isinstance(k, tuple):  # (epoch, k): a persistent worker, which serves every epoch
            epoch, k = k
            if epoch != self.epoch:
                self.epoch, self.batches = epoch, epoch_batches(*self.plan, self.cfg, epoch)
        if torch.utils.data.get_worker_info() is not None:  # a worker process: DataLoader runs it on one thread
            return self._batch(k)
        # In the calling process (num_workers=0): per-image ops are tiny, and intra-op threading makes them several
        # times slower (measured 8x on 2 busy cores). One thread for this batch only: the caller's count is put
        # back on return and on an error, so the process's setting is the caller's between batches.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._batch(k)
        finally:
            torch.set_num_threads(threads)

    def _batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        cfg = self.cfg
        idx = self.batches[k]
        u, flips = draw_params(len(idx), batch_generator(cfg.seed, self.epoch, cfg.shard_id, k), cfg.flip)
        imgs, labels, bad, keep = [], [], [], []
        for j, i in enumerate(idx):
            s = self.samples[i]
            try:
                imgs.append(decode_cpu(s.read(), cfg.apply_exif_orientation))
            except (DecodeError, OSError) as exc:
                bad.append(f"{s.path}@{s.offset}: {exc}")
                continue
            labels.append(s.label)
            keep.append(j)
        if imgs and cfg.size <= BATCHED_CPU_MAX_SIZE:  # small outputs: one gather-blend for the batch (see above)
            keep_t = torch.tensor(keep, dtype=torch.long)
            return transform_batch(imgs, u[keep_t], flips[keep_t], cfg), torch.tensor(labels, dtype=torch.long), bad
        boxes: list[Any] = [None] * len(imgs)
        if cfg.train and imgs:  # one vectorized draw of all boxes (the same numbers transform_one would compute)
            hw = torch.tensor([[im.shape[1], im.shape[2]] for im in imgs])
            boxes = rrc_boxes(hw, u[keep], cfg.scale, cfg.ratio).tolist()
        outs = [transform_one(im, u[j], bool(flips[j]), cfg, box) for im, j, box in zip(imgs, keep, boxes)]
        if not outs:
            return torch.empty(0), torch.empty(0, dtype=torch.long), bad
        return finish(torch.stack(outs), cfg), torch.tensor(labels, dtype=torch.long), bad


class _EpochKeys(torch.utils.data.Sampler):
    """The keys (epoch, k) of one epoch's batches, set before each epoch: the sampler of a persistent DataLoader."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


def reader_context() -> Any:
    """How overdrive's loaders start their worker processes: forked, unless CUDA is initialized in this process
    (a model on the GPU, earlier training); then from a forkserver (started once, without CUDA, with torch and
    overdrive.data imported already, so the workers it forks start about as fast as forked ones).

    Forking a process that has initialized CUDA and runs threads (CUDA's own, pin-memory and loader threads)
    is unsafe: forked GPU-pipeline readers died with cudaErrorInitializationError on the H200, and forked
    DataLoader workers hung for good in the GPU demo's data stage. Use it for any DataLoader with workers:
    ``DataLoader(ds, num_workers=4, multiprocessing_context=reader_context())``.

    Example:
        >>> reader_context() is None or reader_context().get_start_method() == "forkserver"
        True
    """
    import multiprocessing as mp

    if torch.cuda.is_initialized() and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["overdrive.data.loader"])  # no effect once the server runs
        return ctx
    return None


class _BytesDataset(torch.utils.data.Dataset):
    """Item i = batch ``order[i]`` of one epoch as read, undecoded: the GPU pipeline's reader.

    Returns (batch index, packed bytes (uint8), sizes, nvJPEG-safe flags, labels, positions in the
    batch, unreadable files): one buffer per batch, so a worker process hands it over through shared
    memory in one piece. With ``exif`` (``apply_exif_orientation``) a rotated JPEG is flagged for the CPU."""

    def __init__(self, samples: list[Sample], batches: list[list[int]], order: list[int], exif: bool = False) -> None:
        self.samples, self.batches, self.order, self.exif = samples, batches, order, exif

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
        k = self.order[i]
        parts, ok, labels, keep, bad = [], [], [], [], []
        for j, idx in enumerate(self.batches[k]):
            s = self.samples[idx]
            try:
                b = s.read()
            except OSError as exc:
                bad.append(f"{s.path}@{s.offset}: {exc}")
                continue
            parts.append(b)
            ok.append(gpu_decodable(b, self.exif))
            labels.append(s.label)
            keep.append(j)
        blob = b"".join(parts)
        packed = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        return (k, packed, torch.tensor([len(p) for p in parts], dtype=torch.long), torch.tensor(ok, dtype=torch.bool),
                torch.tensor(labels, dtype=torch.long), torch.tensor(keep, dtype=torch.long), bad)


def _shutdown(dl_iter: Any) -> None:
    """Stop a DataLoader iterator's worker processes now (not at GC) and join its queues' feeder threads."""
    if hasattr(dl_iter, "_shutdown_workers"):
        dl_iter._shutdown_workers()
        # The index queues' feeder threads exit on their own after close(); wait for them here,
        # so no thread of ours outlives the loop (a test caught them still alive right after).
        queues = [*getattr(dl_iter, "_index_queues", []), getattr(dl_iter, "_worker_result_queue", None)]
        for q in queues:
            feeder = getattr(q, "_thread", None)
            if feeder is not None:
                feeder.join(timeout=10)


def empty_batch(cfg: LoaderConfig) -> torch.Tensor:
    """A batch of no images, in the loader's output dtype and layout: (0, 3, size, size)."""
    x = torch.empty(0, 3, cfg.size, cfg.size, dtype=cfg.dtype)
    return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x


class ImageLoader:
    """Batches of augmented images from a folder, tar shards or a file list, on CPU or GPU.

    Example:
        >>> # loader = ImageLoader("train/", batch_size=256, device="cuda", size=224, seed=0,
        >>> #                      shard_id=rank, num_shards=world, drop_last=True,
        >>> #                      dtype=torch.bfloat16, channels_last=True, pipeline="auto")
        >>> # for epoch in range(epochs):
        >>> #     loader.set_epoch(epoch)
        >>> #     for images, labels in loader: ...
    """

    def __init__(self, source: str | os.PathLike | Sequence, batch_size: int | None = None, device: str | torch.device = "cpu",
                 config: LoaderConfig | None = None, shuffle: bool | None = None, **overrides: Any) -> None:
        cfg = config or LoaderConfig()
        if batch_size is not None:  # given here, it wins over the config's; else the config's (default 256)
            overrides["batch_size"] = batch_size
        # only unknown names are "unknown options": a TypeError from validating a known one (scale=None) said so too
        unknown = sorted(set(overrides) - {f.name for f in fields(LoaderConfig)})
        dali = [f"{name}= (DALI's) is {DALI_OPTIONS[name]}" for name in unknown if name in DALI_OPTIONS]
        if dali:  # a ported DALI pipeline's arguments: say what each one is called here
            raise UsageError(f"ImageLoader got DALI option(s) {unknown}; here " + "; ".join(dali))
        if unknown:
            raise UsageError(f"ImageLoader got unknown option(s) {unknown}; options are LoaderConfig's fields: "
                             f"{[f.name for f in fields(LoaderConfig)]}")
        self.config = replace(cfg, **overrides)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):  # torch's message lists every device type it knows
            raise UsageError(f"device={device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("device='cuda' but CUDA is not available here; use device='cpu'")
        self.samples, self.classes = resolve(source)
        if shuffle is not None and not isinstance(shuffle, (bool, np.bool_)):  # shuffle="no" is truthy: it shuffled
            raise UsageError(f"shuffle={shuffle!r} must be True, False or None (None: shuffle when train=True)")
        self.shuffle = self.config.train if shuffle is None else bool(shuffle)
        self.epoch = 0
        self.stats = LoaderStats()
        self.decision: str | None = None  # why `auto` picked what it picked
        self._persistent: tuple[torch.utils.data.DataLoader, _EpochKeys] | None = None  # persistent_workers
        self._persistent_user: object | None = None  # the iteration running on the kept workers, if any
        self._epoch_done = False  # a pass over self.epoch ran to its end, and set_epoch() was not called since
        self._repeat_warned = False
        self._position = (0, 0)  # (epoch, batches taken) of the latest pass, for state_dict()
        self._counting: object | None = None  # the pass that counts them
        self._resume_at = 0  # load_state_dict(): the batch the next pass starts at
        if len(self) == 0:  # a loop over it would end at once, every epoch (torch's DataLoader says nothing)
            n = len(self._indices())
            warnings.warn(f"overdrive.data: batch_size={self.config.batch_size} with drop_last=True leaves no batch: "
                          f"this shard has {n} image(s) ({len(self.samples)} in all, {self.config.num_shards} "
                          "shard(s)), so every epoch yields nothing; use a smaller batch_size or drop_last=False",
                          RuntimeWarning, stacklevel=2)
        self._check_shards()
        self.pipeline = self._choose(self.config.pipeline)

    def _check_shards(self) -> None:
        """Warn when this process is one rank of several and the loader's shards do not follow the ranks.

        Unlike DistributedSampler, the loader takes its shard from ``shard_id`` / ``num_shards`` only; left at
        their defaults under torchrun, every rank read the whole dataset in the same order, so DDP averaged
        identical batches (world_size times the data per epoch, no error). ``shard_id=LOCAL_RANK`` on several
        nodes gave the ranks of each node the same shards as the first node's.
        """
        where = rank_and_world()
        if where is None:
            return
        rank, world = where
        c = self.config
        if world > 1 and c.num_shards == 1 and self.shuffle:
            warnings.warn(f"overdrive.data: this process is rank {rank} of {world} and the loader has num_shards=1, so "
                          "every rank reads the whole dataset in the same order (the same batches on every rank); "
                          "pass shard_id=rank, num_shards=world_size, e.g. ImageLoader(src, shard_id=dist.get_rank(), "
                          "num_shards=dist.get_world_size()), or shuffle=False where every rank should see every sample",
                          RuntimeWarning, stacklevel=3)
        elif c.num_shards == world and c.shard_id != rank:
            warnings.warn(f"overdrive.data: shard_id={c.shard_id} with num_shards={world} on rank {rank} of {world}: "
                          "two ranks read the same shard and another shard is never read, unless every rank maps its "
                          "own; pass shard_id=rank (the global rank, not LOCAL_RANK)", RuntimeWarning, stacklevel=3)

    def __getstate__(self) -> dict[str, Any]:
        # the kept worker processes belong to this process: a copy (pickle, deepcopy) starts its own
        state = dict(self.__dict__)
        state["_persistent"] = state["_persistent_user"] = state["_counting"] = None
        return state

    # --- DataLoader-like surface --------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Reshuffle (and redraw the augmentations) for ``epoch``, identically on every rank."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral):  # int(1.5) picked epoch 1's order
            raise UsageError(f"set_epoch({epoch!r}): expected the epoch number as an int, e.g. loader.set_epoch(3)")
        if int(epoch) != self.epoch:  # another epoch: a position loaded for the old one does not carry over
            self._resume_at = 0
        self.epoch = int(epoch)
        self._epoch_done = False

    def _indices(self) -> list[int]:
        c = self.config
        return shard_indices(len(self.samples), self.epoch, c.seed, c.shard_id, c.num_shards, c.drop_last, self.shuffle)

    def _batches(self) -> list[list[int]]:
        return epoch_batches(len(self.samples), self.shuffle, self.config, self.epoch)

    def __len__(self) -> int:
        """Batches per epoch on this shard."""
        n, bs = len(self._indices()), self.config.batch_size
        return n // bs if self.config.drop_last else math.ceil(n / bs)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.stats = LoaderStats()
        batches = self._batches()
        # the epoch is read now, with the batch order: a set_epoch() before the first next() must not give
        # this epoch's order with the next epoch's augmentations (the generators start lazily)
        epoch = self.epoch
        if getattr(self, "_epoch_done", False) and (self.shuffle or self.config.train) and not self._repeat_warned:
            # The epoch keys the order and the random crops (DistributedSampler's contract), so a loop written for
            # DataLoader(shuffle=True), which reshuffles and redraws on every pass, trained on one fixed crop of each
            # image in one fixed order, every epoch, silently.
            self._repeat_warned = True
            warnings.warn(f"overdrive.data: a new pass over the loader at epoch {epoch}, the epoch whose pass already "
                          "ran to its end: it repeats that pass's order and random crops and flips exactly (the epoch, "
                          "not the pass, keys them, as with DistributedSampler); call loader.set_epoch(epoch) before "
                          "each epoch", RuntimeWarning, stacklevel=2)
        start, self._resume_at = self._resume_at, 0
        if self.pipeline == "gpu":
            it = self._iter_gpu(batches, epoch, start)
        else:
            it = self._iter_cpu(batches, epoch=epoch, start=start)
        return self._track(it, epoch, start)

    def _track(self, it: Iterator[tuple[torch.Tensor, torch.Tensor]], epoch: int,
               start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``it``, counting the batches taken (for state_dict) and noting when it runs to its end (an early break is
        not a finished epoch)."""
        # a pass started inside another (a batch taken for logging within the epoch's loop) leaves the count alone
        token = object()
        own = getattr(self, "_counting", None) is None
        if own:
            self._counting, self._position = token, (epoch, start)
        try:
            for batch in it:
                if own:
                    self._position = (epoch, self._position[1] + 1)
                yield batch
        finally:
            if own:
                self._counting = None
        if self.epoch == epoch:
            self._epoch_done = True

    def state_dict(self) -> dict[str, int]:
        """Where the epoch stands: the epoch and the batches taken from its latest pass. Saved with a mid-epoch
        checkpoint, :meth:`load_state_dict` makes the next pass yield exactly the batches not yet taken, with the
        same images, crops and flips they would have had (as torchdata's StatefulDataLoader).

        Example:
            >>> # for i, (x, y) in enumerate(loader):
            >>> #     ...; if i == 99: torch.save({"model": ..., "data": loader.state_dict()}, "ckpt.pt")
            >>> # loader.load_state_dict(torch.load("ckpt.pt", weights_only=True)["data"])
            >>> # for x, y in loader: ...  # batch 100 on
        """
        epoch, taken = self._position
        if epoch != self.epoch:  # set_epoch() since that pass: the new epoch has not started
            epoch, taken = self.epoch, 0
        c = self.config
        return {"epoch": epoch, "batches_taken": taken, "num_batches": len(self), "num_samples": len(self.samples),
                "batch_size": c.batch_size, "seed": c.seed, "shard_id": c.shard_id, "num_shards": c.num_shards}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict`: the next pass starts at its epoch's first batch not yet taken (a
        finished epoch: the next pass is empty; call ``set_epoch(epoch + 1)`` for the next one). The dataset,
        batch size, seed and sharding must be those of the saved loader, or the remaining batches would be others."""
        c = self.config
        now = {"num_samples": len(self.samples), "batch_size": c.batch_size, "seed": c.seed, "shard_id": c.shard_id,
               "num_shards": c.num_shards, "num_batches": len(self)}
        if not isinstance(state, dict) or not {"epoch", "batches_taken", *now} <= set(state):
            raise UsageError(f"load_state_dict() takes what ImageLoader.state_dict() returned; got {state!r}")
        differ = {k: (state[k], v) for k, v in now.items() if state[k] != v}
        if differ:
            raise UsageError("load_state_dict(): the saved loader differs from this one in " + ", ".join(
                f"{k} (saved {a}, here {b})" for k, (a, b) in differ.items()) + "; build the loader as it was "
                "saved, or start the epoch afresh with set_epoch(epoch)")
        taken = state["batches_taken"]
        if not 0 <= taken <= len(self):
            raise UsageError(f"load_state_dict(): batches_taken={taken} must be in [0, {len(self)}]")
        self.set_epoch(state["epoch"])
        self._resume_at = taken

    def __repr__(self) -> str:
        return (f"ImageLoader({len(self.samples)} images, {len(self)} batches of {self.config.batch_size}, "
                f"pipeline={self.pipeline!r}, device={self.device})")

    # --- the CPU pipeline -----------------------------------------------------------------------
    def _iter_cpu(self, batches: list[list[int]], config: LoaderConfig | None = None,
                  epoch: int | None = None, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        cfg = config or self.config
        epoch = self.epoch if epoch is None else epoch
        keep = config is None and cfg.persistent_workers and cfg.num_workers > 0  # the epoch's own batches only
        if keep and getattr(self, "_persistent_user", None) is not None:
            # another iteration of this loader holds the kept workers (a batch taken for logging inside the epoch's
            # loop, zip(loader, loader)): a DataLoader has one iterator, which this one would reset, cutting that
            # epoch short. This one gets workers of its own.
            keep = False
        owner = object()
        if keep:
            self._persistent_user = owner
            dl = self._persistent_loader(epoch, len(batches), start)
        else:
            ds = _BatchDataset(self.samples, batches, cfg, epoch)
            kw: dict[str, Any] = {"prefetch_factor": cfg.prefetch,
                                  "multiprocessing_context": reader_context()} if cfg.num_workers > 0 else {}
            # batches from `start` on (a resumed epoch), each under its own index k: the same draws as in full
            dl = torch.utils.data.DataLoader(ds, batch_size=None, sampler=range(start, len(batches)),
                                             num_workers=cfg.num_workers,
                                             pin_memory=self.device.type == "cuda", **kw)
        dl_iter = iter(dl)
        done = False
        try:
            for x, y, bad in dl_iter:
                self._note_bad(bad)
                if x.numel() == 0:  # every file of this batch was undecodable: an empty batch keeps len() and
                    x = empty_batch(cfg)  # the ranks' step counts (skipping it left one rank a step short)
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                self.stats.batches += 1
                self.stats.images += x.shape[0]
                yield x, y
            done = True
        finally:
            if keep and getattr(self, "_persistent_user", None) is owner:
                self._persistent_user = None
            if not (keep and done):  # an early break (or an error): stop the worker processes now, not at GC
                _shutdown(dl_iter)
                if keep:
                    self._persistent = None  # the next epoch starts new workers
            del dl_iter

    def _persistent_loader(self, epoch: int, n_batches: int, start: int = 0) -> torch.utils.data.DataLoader:
        """The DataLoader whose workers this loader keeps across epochs (``persistent_workers``), made on first use;
        its sampler set to this epoch's batch keys."""
        if getattr(self, "_persistent", None) is None:
            cfg = self.config
            ds = _BatchDataset(self.samples, [], cfg, -1, plan=(len(self.samples), self.shuffle))
            keys = _EpochKeys()
            dl = torch.utils.data.DataLoader(ds, batch_size=None, sampler=keys, num_workers=cfg.num_workers,
                                             pin_memory=self.device.type == "cuda", prefetch_factor=cfg.prefetch,
                                             multiprocessing_context=reader_context(), persistent_workers=True)
            self._persistent = (dl, keys)
        dl, keys = self._persistent
        keys.keys = [(epoch, k) for k in range(start, n_batches)]
        return dl

    def close(self) -> None:
        """Stop the worker processes kept across epochs (``persistent_workers``); the next epoch starts new ones.

        Example:
            >>> # loader = ImageLoader("train/", persistent_workers=True); ...; loader.close()
        """
        kept, self._persistent = getattr(self, "_persistent", None), None
        if kept is not None and kept[0]._iterator is not None:
            _shutdown(kept[0]._iterator)
            kept[0]._iterator = None

    def _note_bad(self, bad: list[str]) -> None:
        for b in bad:
            self.stats.skipped += 1
            self.stats.skipped_files.append(b)
            warnings.warn(f"overdrive.data: skipped an undecodable image: {b}", RuntimeWarning, stacklevel=3)

    # --- the GPU pipeline -----------------------------------------------------------------------
    def _iter_gpu(self, batches: list[list[int]], epoch: int | None = None,
                  start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``gpu_threads`` producers (batch k goes to producer k % T, each with its own CUDA stream, bounded
        queue and reader: a DataLoader whose ``read_workers`` processes read and pack the bytes); this
        consumer takes batches back in order."""
        cfg, device = self.config, self.device
        epoch = self.epoch if epoch is None else epoch
        T = min(cfg.gpu_threads, max(len(batches), 1))
        queues: list[queue.Queue] = [queue.Queue(maxsize=cfg.prefetch) for _ in range(T)]
        stop = threading.Event()
        readers_total = min(cfg.read_workers, os.cpu_count() or 1)
        workers = max(1, readers_total // T) if readers_total > 0 else 0
        readers = []
        for t in range(T):  # workers fork here, in the calling thread, before any producer thread starts
            ds = _BytesDataset(self.samples, batches, [k for k in range(t, len(batches), T) if k >= start], cfg.apply_exif_orientation)
            kw: dict[str, Any] = {"prefetch_factor": cfg.prefetch + 1,
                                  "multiprocessing_context": reader_context()} if workers else {}
            readers.append(iter(torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=workers, **kw)))

        def put(q: queue.Queue, item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce(t: int) -> None:
            q = queues[t]
            try:
                if device.index is not None:
                    torch.cuda.set_device(device)
                side = torch.cuda.Stream(device=device)
                for k, packed, sizes, ok, labels, keep, bad in readers[t]:
                    if stop.is_set():
                        return
                    datas = list(packed.split(sizes.tolist())) if len(sizes) else []
                    u, flips = draw_params(len(batches[k]), batch_generator(cfg.seed, epoch, cfg.shard_id, k), cfg.flip)
                    with torch.cuda.stream(side):
                        imgs, fallback = decode_gpu(datas, device, ok.tolist(), cfg.apply_exif_orientation)
                        good = [j for j, im in enumerate(imgs) if im is not None]
                        bad += [f"{self.samples[batches[k][int(keep[j])]].path}: cannot decode"
                                for j, im in enumerate(imgs) if im is None]
                        x = y = None
                        if good:
                            sel = keep[good]  # positions in the batch: each sample keeps its own draws
                            x = transform_batch([imgs[j] for j in good], u[sel], flips[sel], cfg, fused=cfg.fused)
                            y = labels[good].pin_memory().to(device, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(side)
                    if not put(q, (x, y, event, bad, fallback)):
                        return
            except BaseException as exc:  # hand any failure to the consumer, in this batch's place
                put(q, exc)

        threads = [threading.Thread(target=produce, args=(t,), name=f"overdrive-gpu-loader-{t}", daemon=True)
                   for t in range(T)]
        for th in threads:
            th.start()
        try:
            for k in range(start, len(batches)):
                item = queues[k % T].get()
                if isinstance(item, BaseException):
                    raise item
                x, y, event, bad, fallback = item
                self._note_bad(bad)
                self.stats.cpu_fallback += fallback
                if x is None:  # every file undecodable: an empty batch, as on the CPU path
                    x, y = empty_batch(cfg).to(device), torch.empty(0, dtype=torch.long, device=device)
                    self.stats.batches += 1
                    yield x, y
                    continue
                cur = torch.cuda.current_stream(device)
                cur.wait_event(event)
                x.record_stream(cur)  # x was allocated on a side stream: keep it alive while cur reads it
                y.record_stream(cur)
                self.stats.batches += 1
                self.stats.images += x.shape[0]
                yield x, y
        finally:
            stop.set()
            for th in threads:
                while th.is_alive():  # unblock producers waiting on a full queue
                    for q in queues:
                        try:
                            q.get_nowait()
                        except queue.Empty:
                            pass
                    th.join(timeout=0.05)
            for r in readers:
                _shutdown(r)

    # --- choosing a pipeline --------------------------------------------------------------------
    def _choose(self, pipeline: str) -> str:
        if pipeline == "cpu":
            return "cpu"
        if pipeline == "gpu":
            if self.device.type != "cuda":
                raise UsageError("pipeline='gpu' needs device='cuda'; use pipeline='cpu' or 'auto' on CPU")
            return "gpu"
        from overdrive.data.auto import choose_pipeline  # pipeline == "auto"

        choice, reason = choose_pipeline(self)
        self.decision = reason
        return choice
