"""ImageLoader on CPU: determinism, sharding, len/drop_last, sources, robustness, clean shutdown."""

from __future__ import annotations

import io
import tarfile
import threading
import warnings
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive.data import ImageLoader, LoaderConfig, shard_indices
from overdrive.data.decode import decode_cpu, jpeg_info
from overdrive.data.transforms import batch_generator, draw_params, reference_batch


def _collect(loader: ImageLoader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*list(loader))
    return torch.cat(xs), torch.cat(ys)


def test_deterministic_with_seed_and_epoch(folder: Path) -> None:
    kw = dict(batch_size=5, size=20, num_workers=0, seed=3)
    a, b = ImageLoader(folder, **kw), ImageLoader(folder, **kw)
    xa, ya = _collect(a)
    xb, yb = _collect(b)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    b.set_epoch(1)
    xc, yc = _collect(b)
    assert not torch.equal(ya, yc)  # reshuffled
    c = ImageLoader(folder, **{**kw, "seed": 4})
    assert not torch.equal(_collect(c)[0], xa)


def test_workers_give_the_same_batches(folder: Path) -> None:
    x0, y0 = _collect(ImageLoader(folder, batch_size=4, size=16, num_workers=0))
    x2, y2 = _collect(ImageLoader(folder, batch_size=4, size=16, num_workers=2))
    assert torch.equal(x0, x2) and torch.equal(y0, y2)


@pytest.mark.parametrize("size", [24, 72])  # one transform for the whole batch (<= 64), and image by image
def test_outputs_match_reference_transform(folder: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import overdrive.data.loader as loader_mod

    batched = size <= loader_mod.BATCHED_CPU_MAX_SIZE
    calls: list[str] = []
    for name in ("transform_batch", "transform_one"):
        real = getattr(loader_mod, name)
        monkeypatch.setattr(loader_mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    loader = ImageLoader(folder, batch_size=6, size=size, num_workers=0, seed=1)
    for k, (x, y) in enumerate(loader):
        idx = loader._batches()[k]
        imgs = [decode_cpu(loader.samples[i].read()) for i in idx]
        u, f = draw_params(len(idx), batch_generator(1, 0, 0, k), 0.5)
        torch.testing.assert_close(x, reference_batch(imgs, u, f, loader.config), atol=1e-5, rtol=0)
        assert y.tolist() == [loader.samples[i].label for i in idx]
    assert calls and set(calls) == {"transform_batch" if batched else "transform_one"}


def test_eval_mode_is_deterministic_center_crop(folder: Path) -> None:
    a = ImageLoader(folder, batch_size=8, size=16, train=False, num_workers=0)
    xa, ya = _collect(a)
    a.set_epoch(5)
    xb, yb = _collect(a)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)  # no shuffle, no randomness in eval
    assert ya.tolist() == [s.label for s in a.samples]


@pytest.mark.parametrize("n,shards,drop_last", [(22, 3, False), (22, 3, True), (7, 4, False), (20, 4, True), (3, 5, False)])
def test_sharding_covers_every_sample_once(n: int, shards: int, drop_last: bool) -> None:
    parts = [shard_indices(n, 2, 0, s, shards, drop_last) for s in range(shards)]
    assert len({len(p) for p in parts}) == 1  # every rank takes the same number of steps
    flat = [i for p in parts for i in p]
    if drop_last:
        assert len(flat) == len(set(flat)) == (n // shards) * shards
    else:
        assert set(flat) == set(range(n))
        assert len(flat) - n == (-n) % shards  # padding: only the wrap-around repeats


def test_len_and_drop_last(folder: Path) -> None:
    for bs, drop, shards in [(5, False, 1), (5, True, 1), (4, False, 3), (4, True, 3), (30, False, 1), (30, True, 1)]:
        with warnings.catch_warnings():  # (30, True): no batch, which the loader warns about
            warnings.simplefilter("ignore", RuntimeWarning)
            loaders = [ImageLoader(folder, batch_size=bs, size=8, drop_last=drop, num_workers=0, shard_id=s,
                                   num_shards=shards) for s in range(shards)]
        per = (22 // shards) if drop else -(-22 // shards)
        want = per // bs if drop else -(-per // bs)
        for ld in loaders:
            batches = list(ld)
            assert len(ld) == len(batches) == want
            if drop:
                assert all(b[0].shape[0] == bs for b in batches)
        seen = torch.cat([y for ld in loaders for _, y in ld]) if want else torch.empty(0)
        assert len(seen) == (want * bs * shards if drop else -(-22 // shards) * shards)


def test_sources_folder_tar_and_list_agree(folder: Path, tmp_path: Path) -> None:
    ref = ImageLoader(folder, batch_size=8, size=16, num_workers=0)
    pairs = [(s.path, s.label) for s in ref.samples]
    listfile = tmp_path / "list.txt"
    listfile.write_text("".join(f"{p} {lab}\n" for p, lab in pairs))
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        with tarfile.open(shards / f"part-{k}.tar", "w") as tf:
            for i, (p, lab) in enumerate(pairs):
                if i % 2 != k:
                    continue
                tf.add(p, arcname=f"{i:05d}.jpg")
                cls = tmp_path / f"{i}.cls"
                cls.write_text(str(lab))
                tf.add(cls, arcname=f"{i:05d}.cls")
    via_list = ImageLoader(listfile, batch_size=8, size=16, num_workers=0)
    via_pairs = ImageLoader(pairs, batch_size=8, size=16, num_workers=0)
    via_tar = ImageLoader(shards, batch_size=8, size=16, num_workers=0)
    x0, y0 = _collect(ref)
    for other in (via_list, via_pairs):
        x, y = _collect(other)
        assert torch.equal(x, x0) and torch.equal(y, y0)
    # tar order differs (sorted by shard, then key): compare as multisets of (label, image)
    assert sorted(s.read() for s in via_tar.samples) == sorted(s.read() for s in ref.samples)
    xt, yt = _collect(via_tar)
    assert xt.shape == x0.shape and sorted(yt.tolist()) == sorted(y0.tolist())


def test_formats_decode_and_corrupt_files_are_skipped(mixed: Path) -> None:
    loader = ImageLoader(mixed, batch_size=3, size=16, num_workers=0, train=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = _collect(loader)
    assert x.shape[0] == 6  # baseline, progressive, gray, cmyk, png, rgba png
    assert loader.stats.skipped == 2 and loader.stats.images == 6
    assert any("corrupt.jpg" in f for f in loader.stats.skipped_files)
    assert any("truncated.jpg" in f for f in loader.stats.skipped_files)
    assert sum("undecodable" in str(w.message) for w in caught) == 2
    # all decodes are the same picture: compare to the baseline decode (JPEG/CMYK conversion error only)
    base = decode_cpu((mixed / "a" / "baseline.jpg").read_bytes()).float()
    for name in ["progressive.jpg", "cmyk.jpg"]:
        img = decode_cpu((mixed / "a" / name).read_bytes()).float()
        assert img.shape == base.shape and (img - base).abs().mean() < 4
    png = decode_cpu((mixed / "b" / "rgba.png").read_bytes())
    assert png.shape[0] == 3
    gray = decode_cpu((mixed / "a" / "gray.jpg").read_bytes())
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])


def test_jpeg_info_routes_to_gpu_only_safe_files(mixed: Path) -> None:
    info = {p.name: jpeg_info(p.read_bytes()) for p in mixed.rglob("*.*")}
    assert info["baseline.jpg"].gpu_ok and info["gray.jpg"].gpu_ok
    assert info["progressive.jpg"].progressive and not info["progressive.jpg"].gpu_ok
    assert info["cmyk.jpg"].components == 4 and not info["cmyk.jpg"].gpu_ok
    assert not info["image.png"].is_jpeg and not info["truncated.jpg"].gpu_ok and not info["corrupt.jpg"].gpu_ok


def test_gpu_reader_packs_bytes_exactly(mixed: Path, tmp_path: Path) -> None:
    """The GPU pipeline's reader (runs in worker processes): one packed buffer per batch that splits back
    into each file's exact bytes, nvJPEG-safe flags from the headers, labels, and unreadable files named."""
    from overdrive.data.loader import _BytesDataset
    from overdrive.data.sources import Sample, resolve

    samples, _ = resolve(mixed)
    samples = [*samples, Sample(str(tmp_path / "gone.jpg"), 1)]  # a file deleted after listing
    batches = [list(range(len(samples)))]
    k, packed, sizes, ok, labels, keep, bad = _BytesDataset(samples, batches, [0])[0]
    assert k == 0 and len(bad) == 1 and "gone.jpg" in bad[0]
    assert keep.tolist() == list(range(len(samples) - 1))
    for part, j in zip(packed.split(sizes.tolist()), keep.tolist()):
        raw = samples[j].read()
        assert part.numpy().tobytes() == raw
        assert bool(ok[j]) == jpeg_info(raw).gpu_ok
        assert int(labels[j]) == samples[j].label


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_early_break_leaves_no_threads_or_processes(folder: Path, workers: int, persistent: bool) -> None:
    import multiprocessing as mp

    before = {t.ident for t in threading.enumerate()}
    loader = ImageLoader(folder, batch_size=2, size=8, num_workers=workers, persistent_workers=persistent)
    it = iter(loader)
    next(it)
    it.close()  # what a `break` out of a for loop does when the iterator is dropped
    for _ in range(3):  # and a plain break inside a loop
        for _x, _y in loader:
            break
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
    assert not [p for p in mp.active_children() if p.is_alive()]


def test_bad_inputs_raise_usage_errors(tmp_path: Path, folder: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        ImageLoader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no class subfolders"):
        ImageLoader(tmp_path / "empty")
    with pytest.raises(UsageError, match="unknown option"):
        ImageLoader(folder, batch_size=2, bogus=1)
    with pytest.raises(UsageError, match="needs device='cuda'"):
        ImageLoader(folder, pipeline="gpu")
    bad = tmp_path / "bad.txt"
    bad.write_text("a.jpg notanumber\n")
    with pytest.raises(UsageError, match="integer label"):
        ImageLoader(bad)
    with pytest.raises(UsageError, match="does not exist"):
        ImageLoader([("missing.jpg", 0)])
    for field, value, lowest in (("num_workers", -1, 0), ("read_workers", -2, 0), ("gpu_threads", 0, 1), ("prefetch", 0, 1)):
        with pytest.raises(UsageError, match=f"^{field}={value} must be >= {lowest}"):
            ImageLoader(folder, **{field: value})
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="CUDA is not available"):
            ImageLoader(folder, device="cuda")


def test_auto_on_cpu_says_why(folder: Path) -> None:
    loader = ImageLoader(folder, batch_size=4, size=8, pipeline="auto")
    assert loader.pipeline == "cpu" and "CPU" in (loader.decision or "")


def test_config_object_and_overrides(folder: Path) -> None:
    cfg = LoaderConfig(size=12, train=False, num_workers=0)
    loader = ImageLoader(folder, batch_size=3, config=cfg, dtype="bf16", channels_last=True)
    x, _ = next(iter(loader))
    assert x.shape == (3, 3, 12, 12) and x.dtype == torch.bfloat16
    assert x.is_contiguous(memory_format=torch.channels_last)


def test_config_batch_size_is_used_when_none_is_given(folder: Path) -> None:
    """ImageLoader(config=LoaderConfig(batch_size=8)) runs with 8 (the argument's default of 256 overrode it)."""
    loader = ImageLoader(folder, config=LoaderConfig(batch_size=8, size=16, num_workers=0))
    assert loader.config.batch_size == 8 and len(loader) == 3 and next(iter(loader))[0].shape[0] == 8
    assert ImageLoader(folder, batch_size=4, config=LoaderConfig(batch_size=8)).config.batch_size == 4


def test_all_corrupt_batch_comes_out_empty_so_ranks_agree(folder: Path) -> None:
    """A batch whose files are all undecodable is yielded empty, not skipped: every shard yields len() batches
    (a skipped batch left one rank a step short, and DDP's collectives would hang)."""
    files = sorted(folder.rglob("*.jpg"))
    for f in files[:4]:
        f.write_bytes(b"not an image")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for shard in range(2):
            loader = ImageLoader(folder, batch_size=1, size=16, num_workers=0, shuffle=False, num_shards=2,
                                 shard_id=shard, drop_last=True, channels_last=True)
            batches = list(loader)
            assert len(batches) == len(loader) == 11
            empty = [x for x, _ in batches if x.shape[0] == 0]
            assert empty and all(x.shape == (0, 3, 16, 16) and x.is_contiguous(memory_format=torch.channels_last)
                                 for x in empty)
            assert loader.stats.skipped == len(empty)


def test_any_int_seed_works(folder: Path) -> None:
    loader = ImageLoader(folder, batch_size=8, size=16, num_workers=0, seed=time_ns_like())
    assert len(list(loader)) == len(loader) == 3


def time_ns_like() -> int:
    return 1_764_560_000_123_456_789  # a time.time_ns() value: past 2**63 once multiplied into the generator key


def test_tar_caption_txt_is_not_a_label(tmp_path: Path, folder: Path) -> None:
    """WebDataset shards carry captions in .txt: .cls is the label; a non-numeric .txt is ignored, and a
    numeric .txt is used only when there is no .cls."""
    img = sorted(folder.rglob("*.jpg"))[0]
    members = {"a.jpg": img.read_bytes(), "a.cls": b"3", "a.txt": b"a photo of a dog",
               "b.jpg": img.read_bytes(), "b.cls": b"1", "b.txt": b"7",
               "c.jpg": img.read_bytes(), "c.txt": b"5"}
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    loader = ImageLoader([str(shard)], batch_size=3, size=16, num_workers=0, shuffle=False)
    assert [s.label for s in loader.samples] == [3, 1, 5]


def test_set_epoch_between_iter_and_next_keeps_the_epoch_consistent(folder: Path) -> None:
    """iter() fixes the epoch's order; its augmentations must come from the same epoch even when set_epoch
    runs before the first next() (the generator read the new epoch lazily)."""
    loader = ImageLoader(folder, batch_size=8, size=16, num_workers=0, seed=3)
    loader.set_epoch(0)
    ref = [x for x, _ in loader]
    it = iter(loader)
    loader.set_epoch(1)
    got = [x for x, _ in it]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("field,value", [("batch_size", 66 / 4), ("batch_size", 16.0), ("size", 16.5), ("num_shards", 2.0),
                                         ("seed", 1.5), ("num_workers", 1.5), ("batch_size", "8")])
def test_non_integer_counts_are_refused_up_front(folder: Path, field: str, value: object) -> None:
    """batch_size=global / world (a float) was accepted, gave a len(), then failed in the first next()
    (TypeError: slice indices must be integers); seed=1.5 failed in manual_seed."""
    with pytest.raises(UsageError, match=rf"{field}={value!r} must be an int"):
        ImageLoader(folder, **{"pipeline": "cpu", "num_workers": 0, "batch_size": 4, field: value})


def test_numpy_int_settings_round_trip_through_json() -> None:
    np = pytest.importorskip("numpy")
    cfg = LoaderConfig(batch_size=np.int64(8), seed=np.int32(3))  # to_json() raised TypeError: int64 is not JSON serializable
    assert type(cfg.batch_size) is int and LoaderConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("kw,match", [({"scale": None}, r"scale=None must be a sequence of numbers"),
                                      ({"mean": "abc"}, r"mean='abc' must be a sequence of numbers"),
                                      ({"batch_size": "8"}, r"batch_size='8' must be an int"),
                                      ({"batchsize": 8}, r"unknown option\(s\) \['batchsize'\]")])
def test_bad_option_values_are_not_called_unknown_options(folder: Path, kw: dict, match: str) -> None:
    """Every TypeError from validating a known option was reported as 'ImageLoader got an unknown option'."""
    with pytest.raises(UsageError, match=match):
        ImageLoader(folder, **{"pipeline": "cpu", "num_workers": 0, **kw})


def test_persistent_workers_serve_every_epoch_with_the_same_batches(folder: Path) -> None:
    """persistent_workers=True keeps the CPU pipeline's worker processes from one epoch to the next (each epoch used to
    start new ones: on a small epoch their start-up was most of its time); every epoch's batches equal those of
    per-epoch workers, bit for bit, and close() stops them."""
    import multiprocessing as mp

    kw = dict(batch_size=3, size=16, num_workers=2, seed=5)
    fresh, kept = ImageLoader(folder, **kw), ImageLoader(folder, persistent_workers=True, **kw)
    pids = []
    for epoch in range(3):
        fresh.set_epoch(epoch)
        kept.set_epoch(epoch)
        xa, ya = _collect(fresh)
        xb, yb = _collect(kept)
        assert torch.equal(xa, xb) and torch.equal(ya, yb), epoch
        pids.append({p.pid for p in mp.active_children() if p.is_alive()})
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2]  # the same two workers served all three epochs
    kept.close()
    assert not [p for p in mp.active_children() if p.is_alive()]
    xc, _ = _collect(kept)  # after close(), the next epoch starts new workers
    assert torch.equal(xc, xb)
    kept.close()


def test_a_second_iteration_does_not_cut_a_persistent_epoch_short(folder: Path) -> None:
    """With persistent_workers=True every iteration shared one DataLoader iterator: a batch taken with
    ``next(iter(loader))`` inside the epoch's loop reset it, and the loop ended after 4 of 10 batches with other
    labels, silently; ``zip(loader, loader)`` cut both short. Reference: the same epochs without persistent workers."""
    import copy
    import pickle

    kw = dict(batch_size=2, size=8, num_workers=2, seed=0)
    ref = ImageLoader(folder, **kw)
    kept = ImageLoader(folder, persistent_workers=True, **kw)
    xr, yr = _collect(ref)
    seen_x, seen_y = [], []
    for i, (x, y) in enumerate(kept):
        if i == 1:
            peek, _ = next(iter(kept))  # a batch for logging, mid-epoch
            assert torch.equal(peek, xr[: len(peek)])
        seen_x.append(x)
        seen_y.append(y)
    assert len(seen_x) == len(kept) and torch.equal(torch.cat(seen_x), xr) and torch.equal(torch.cat(seen_y), yr)
    pairs = list(zip(kept, kept))
    assert len(pairs) == len(kept) and torch.equal(torch.cat([a[0] for a, _ in pairs]), xr)
    assert torch.equal(torch.cat([b[1] for _, b in pairs]), yr)
    clone = pickle.loads(pickle.dumps(kept))  # a loader that kept workers copies without them
    assert torch.equal(_collect(copy.deepcopy(clone))[0], xr)
    kept.close()


def test_persistent_workers_must_be_a_bool() -> None:
    with pytest.raises(UsageError, match="persistent_workers='yes' must be True or False"):
        LoaderConfig(persistent_workers="yes")


def test_dali_style_mean_and_std_in_pixel_units_are_refused(folder: Path) -> None:
    """DALI's crop_mirror_normalize takes mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375); passed here they
    were divided by 255 a second time and every image came out nearly constant (range -2.12 to -1.79), silently."""
    with pytest.raises(UsageError, match="0-255 pixel units.*divide DALI-style values by 255"):
        ImageLoader(folder, pipeline="cpu", mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
    with pytest.raises(UsageError, match="0-255 pixel units"):
        LoaderConfig(std=(58.395, 57.12, 57.375))
    LoaderConfig(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # 0-1 units, as torchvision's Normalize


def test_a_loader_with_no_batch_says_so(folder: Path) -> None:
    """batch_size larger than the shard with drop_last=True made len(loader) == 0 and every epoch ended at once,
    silently; now a warning with the counts and the fix. drop_last=False keeps its one short batch."""
    n = len(ImageLoader(folder, batch_size=1, pipeline="cpu"))
    with pytest.warns(RuntimeWarning, match=rf"batch_size={n + 1} with drop_last=True leaves no batch: this shard has {n}"):
        ImageLoader(folder, batch_size=n + 1, drop_last=True, pipeline="cpu")
    assert len(ImageLoader(folder, batch_size=n + 1, drop_last=False, pipeline="cpu")) == 1
