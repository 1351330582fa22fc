"""Saves that cannot tear. Reference: every read of the path between and after saves gives a whole file
(the trainer checkpoint loads; the engine file parses). Two processes saving one checkpoint path used the
same fixed ``path.tmp`` and left an unreadable file in some rounds; Engine.save wrote in place, so a
concurrent reader saw an empty or torn engine."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from overdrive._utils.files import atomic_torch_save, atomic_write


def _saver(path: str, rounds: int, seed: int, barrier) -> None:  # noqa: ANN001
    from overdrive.train.checkpoint import save_checkpoint
    from overdrive.train.loop import Trainer

    torch.manual_seed(seed)
    model = torch.nn.Linear(512, 512)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters()), progress=False)
    barrier.wait(timeout=300)  # both writers start together: their saves overlap
    for _ in range(rounds):
        save_checkpoint(path, trainer, extra={"writer": seed})


def test_two_processes_saving_one_checkpoint_never_tear_it(tmp_path: Path) -> None:
    from overdrive.train.checkpoint import load_checkpoint
    from overdrive.train.loop import Trainer

    path = tmp_path / "ckpt.pt"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_saver, args=(str(path), 60, s, barrier)) for s in (1, 2)]
    for p in procs:
        p.start()
    barrier.wait(timeout=300)  # a writer that died before it: BrokenBarrierError, not a hang
    model = torch.nn.Linear(512, 512)
    reader = Trainer(model, torch.optim.AdamW(model.parameters()), progress=False)
    reads = 0
    while any(p.is_alive() for p in procs):
        if path.exists():
            assert load_checkpoint(path, reader, restore_rng=False)["writer"] in (1, 2)
            reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert load_checkpoint(path, reader, restore_rng=False)["writer"] in (1, 2)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary left behind


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "engine.bin"
    atomic_write(path, b"old")
    os.chmod(path, 0o640)

    def broken(src, dst):  # noqa: ANN001
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, b"new" * 1000)
    monkeypatch.undo()
    assert path.read_bytes() == b"old" and sorted(f.name for f in tmp_path.iterdir()) == ["engine.bin"]
    atomic_write(path, "text")
    assert path.read_text() == "text" and (path.stat().st_mode & 0o777) == 0o640  # permissions kept


@pytest.mark.parametrize("writer", ["engine", "sparse", "json"])
def test_project_files_go_through_the_atomic_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """A save that fails before its rename leaves the previous file whole (Engine.save used to write in place)."""
    path = tmp_path / "out.bin"
    path.write_bytes(b"previous")

    def save() -> None:
        if writer == "engine":
            from overdrive.engine.format import EngineFile

            EngineFile({"k": 1}, {"s": b"x" * 100}).save(path)
        elif writer == "sparse":
            from overdrive.sparsity import from_pruned, save_compressed, sparsify

            model = torch.nn.Sequential(torch.nn.Linear(32, 16))
            sparsify(model)
            save_compressed(from_pruned(model), path)
        else:
            from overdrive.cli.common import write_json

            write_json({"a": 1}, str(path))

    def broken(src, dst):  # noqa: ANN001
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        save()
    monkeypatch.undo()
    assert path.read_bytes() == b"previous" and sorted(f.name for f in tmp_path.iterdir()) == ["out.bin"]
    save()
    assert path.read_bytes() != b"previous"


def test_a_write_to_a_folder_or_a_missing_folder_is_one_clear_error(tmp_path) -> None:  # noqa: ANN001
    """``Engine.save(folder)`` raised IsADirectoryError and ``Engine.save("/nonexistent/a.engine")`` FileNotFoundError,
    each naming a hidden temporary file; /proc passed the writability check (root) and failed after the work."""
    import pytest

    from overdrive._utils.errors import UsageError
    from overdrive._utils.files import atomic_write

    with pytest.raises(UsageError, match="it is a folder"):
        atomic_write(tmp_path, b"x")
    with pytest.raises(UsageError, match="does not exist"):
        atomic_write(tmp_path / "missing" / "a.engine", b"x")
    if Path("/proc/self").is_dir():
        with pytest.raises(UsageError, match="takes no new files"):
            atomic_write("/proc/a.engine", b"x")
        from overdrive.cli.common import check_output

        with pytest.raises(UsageError, match="not writable"):
            check_output("--save-engine", "/proc/a.engine")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
@pytest.mark.parametrize("writer", ["atomic_write", "atomic_path"])
def test_a_device_or_pipe_is_written_through_not_replaced(tmp_path: Path, writer: str) -> None:
    # `--json /dev/null` as root renamed a temporary file over /dev/null: the device became a plain file for every
    # process on the machine. A named pipe stands in for the device here (same rule: not a regular file)
    import stat
    import threading

    from overdrive._utils.files import atomic_path, atomic_write

    fifo = tmp_path / "out.pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        if writer == "atomic_write":
            atomic_write(fifo, b"through")
        else:
            with atomic_path(fifo) as p:
                p.write_bytes(b"through")
    finally:
        if not got:  # unblock the reader if the write went elsewhere
            with open(fifo, "wb", buffering=0) as f:
                f.write(b"")
        reader.join(timeout=10)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the pipe was replaced by a file"
    assert got == [b"through"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.pipe"]  # no temporary left
