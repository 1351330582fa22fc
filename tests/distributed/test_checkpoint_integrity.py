"""What a DCP checkpoint folder is trusted with (issue 18), each with a test that failed before its fix:

- no pickle in a folder runs on load: a crafted ``.metadata`` (torch's reader unpickled it) and a
  crafted non-tensor entry (DCP's planner loaded it with ``torch.load(weights_only=False)``), with a
  manifest resealed over them (an attacker can) or without one; a marker file proves nothing ran;
- corruption is detected: a flipped byte in a shard (an Adam moment loaded silently changed),
  a truncated or empty ``.metadata`` (raw UnpicklingError / EOFError before), a missing shard
  ("does not fit this trainer" before) each raise a UsageError naming the file, and ``latest()``
  skips such folders with a warning naming them (it returned them before);
- a fuzz: bytes flipped at seeded positions of the shard, ``.metadata`` and the manifest: every
  load raises the UsageError or restores exactly the saved state;
- ``save(keep=...)`` never removes the folder it just wrote (it did when a newer folder existed).

The two-rank case (a corrupt shard of rank 1, found by rank 1's share of the hashing, raised on
every rank) is in ``test_checkpoint_errors.py`` with the other two-rank checks.
"""

from __future__ import annotations

import copy
import io
import pickle
import random
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.amp import Policy
from overdrive.distributed import checkpoint_files as files
from overdrive.train import Trainer

sys.path.insert(0, str(Path(__file__).parent))
import _checkpoint_errors_worker as cw  # noqa: E402

POSITION = {"sampler": {"epoch": 1, "consumed": 24}, "seen": [1, 2]}


def _touch(path: str) -> None:
    Path(path).write_text("a pickle in the checkpoint ran")


class Marker:
    """Unpickling it writes ``path``: the proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_touch, (self.path,))


def _trainer(policy: Any = "O0") -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), policy=policy, progress=False)


def _trained(steps: int = 2, policy: Any = "O0") -> Trainer:
    t = _trainer(policy)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        t.train_step((torch.randn(4, 8, generator=g), torch.randint(0, 5, (4,), generator=g)))
    return t


def _snapshot(t: Trainer) -> dict[str, Any]:
    return {"model": {k: v.detach().clone() for k, v in t.model.state_dict().items()},
            "optim": copy.deepcopy(t.optimizer.state_dict()), "amp": copy.deepcopy(t.mp.state_dict()),
            "loop": [t.epoch, t.step_count, t.micro_step]}


def _flip(path: Path, pos: int, mask: int = 0x40) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= mask
    path.write_bytes(bytes(data))


def _latest(root: Path) -> tuple[Path | None, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = odist.checkpoint.latest(root)
    return found, " | ".join(str(w.message) for w in caught)


def _outcome(fn: Any) -> BaseException | str:
    """What ``fn()`` raised (DCP's CheckpointException is a BaseException), or "loaded"."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test asserts on it
        return exc
    return "loaded"


def _two_saves(root: Path) -> tuple[Path, Path]:
    """step_00000001 and step_00000002 under ``root``."""
    t = _trained(1)
    first = odist.checkpoint.save(root, t, position=POSITION)
    t.train_step((torch.randn(4, 8), torch.randint(0, 5, (4,))))
    return first, odist.checkpoint.save(root, t, position=POSITION)


# --- 4. no pickle runs ----------------------------------------------------------------------
def _crafted_metadata(real: bytes, marker: Path, how: str) -> bytes:
    if how == "whole":
        return pickle.dumps(Marker(marker))
    md = pickle.loads(real)  # the real metadata (written by this test's own save) with a marker inside
    md.storage_meta.modules = [Marker(marker)]
    return pickle.dumps(md)


@pytest.mark.parametrize("sealed", [True, False], ids=["manifest_resealed", "no_manifest"])
@pytest.mark.parametrize("how", ["whole", "inside_real_metadata"])
def test_crafted_metadata_pickle_never_runs(group: None, tmp_path: Path, how: str, sealed: bool) -> None:
    marker = tmp_path / "marker"
    path = odist.checkpoint.save(tmp_path / "ckpt", _trained(), position=POSITION)
    meta = path / files.METADATA
    meta.write_bytes(_crafted_metadata(meta.read_bytes(), marker, how))
    (path / files.MANIFEST).unlink()
    if sealed:
        files.write_manifest(path)
    found, warned = _latest(tmp_path / "ckpt")
    with warnings.catch_warnings():  # no_manifest: allow_unverified's warning
        warnings.simplefilter("ignore", RuntimeWarning)
        kwargs = {} if sealed else {"allow_unverified": True}
        outcome = _outcome(lambda: odist.checkpoint.load(path, _trainer(), **kwargs))
    assert not marker.exists(), "a pickle in the checkpoint ran"
    assert found is None and "step_00000002" in warned
    assert isinstance(outcome, UsageError), outcome
    assert re.search(r"\.metadata refers to .*_touch.*was not unpickled", str(outcome)), outcome


@pytest.mark.parametrize("layer", ["dcp_entry", "overdrive_blob"])
def test_crafted_entry_pickle_never_runs(group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layer: str) -> None:
    # dcp_entry: DCP's planner unpickles the stored object itself (weights_only=False before);
    # overdrive_blob: the bytes overdrive unpickles afterwards (weights_only=True, but a raw error before).
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save(Marker(marker), buf)
    crafted = Marker(marker) if layer == "dcp_entry" else buf.getvalue()
    with monkeypatch.context() as m:  # what an attacker writes (and reseals with a manifest)
        m.setattr(odist.checkpoint, "_position_blob", lambda position: crafted)
        odist.checkpoint.save(tmp_path, _trained())
    outcome = _outcome(lambda: odist.checkpoint.load(odist.checkpoint.latest(tmp_path), _trainer()))
    assert not marker.exists(), "a pickle in the checkpoint ran"
    assert isinstance(outcome, UsageError), outcome
    assert re.search(r"entry 'position' is not what overdrive writes.*weights_only=True.*nothing in it ran", str(outcome))


# --- 7. corruption is detected --------------------------------------------------------------
def test_flipped_byte_in_an_adam_moment_is_refused(group: None, tmp_path: Path) -> None:
    t = _trained()
    path = odist.checkpoint.save(tmp_path, t)
    moment = next(iter(t.optimizer.state.values()))["exp_avg_sq"]
    shard = path / "__0_0.distcp"
    at = shard.read_bytes().find(moment.numpy().tobytes())
    assert at > 0
    _flip(shard, at + 3)  # the first element's exponent byte: a moment off by orders of magnitude
    found, warned = _latest(tmp_path)
    assert found is None and "checksum mismatch in __0_0.distcp" in warned
    with pytest.raises(UsageError, match=r"step_00000002'?: checksum mismatch in __0_0\.distcp.*latest"):
        odist.checkpoint.load(path, _trainer())


# --- 14. incomplete folders -----------------------------------------------------------------
@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_truncated_metadata_is_named_and_skipped(group: None, tmp_path: Path, damage: str) -> None:
    first, second = _two_saves(tmp_path)
    meta = second / files.METADATA
    meta.write_bytes(b"" if damage == "empty" else meta.read_bytes()[: meta.stat().st_size // 2])
    found, warned = _latest(tmp_path)
    assert found == first and "step_00000002 (.metadata is " in warned and "returning step_00000001" in warned
    with pytest.raises(UsageError, match=r"\.metadata is \d+ bytes and overdrive\.manifest\.json says \d+"):
        odist.checkpoint.load(second, _trainer())
    (second / files.MANIFEST).unlink()  # no manifest either: the unpickler's error, still a UsageError
    with pytest.warns(RuntimeWarning, match="no overdrive.manifest.json"):
        with pytest.raises(UsageError, match=r"\.metadata cannot be read \((EOFError|UnpicklingError)"):
            odist.checkpoint.load(second, _trainer(), allow_unverified=True)


def test_missing_shard_is_named_not_called_a_misfit(group: None, tmp_path: Path) -> None:
    first, second = _two_saves(tmp_path)
    (second / "__0_0.distcp").unlink()
    found, warned = _latest(tmp_path)
    assert found == first and "step_00000002 (shard __0_0.distcp is missing)" in warned
    with pytest.raises(UsageError, match=r"shard __0_0\.distcp is missing") as info:
        odist.checkpoint.load(second, _trainer())
    assert "does not fit" not in str(info.value)


def test_folder_without_manifest_needs_allow_unverified(group: None, tmp_path: Path) -> None:
    # A save that stopped between DCP's .metadata and the manifest, or an overdrive before checksums.
    t = _trained()
    path = odist.checkpoint.save(tmp_path, t, position=POSITION)
    (path / files.MANIFEST).unlink()
    found, warned = _latest(tmp_path)
    assert found is None and "step_00000002 (has no overdrive.manifest.json" in warned
    with pytest.raises(UsageError, match="allow_unverified=True"):
        odist.checkpoint.load(path, _trainer())
    with pytest.warns(RuntimeWarning, match="returned unverified"):
        assert odist.checkpoint.latest(tmp_path, allow_unverified=True) == path
    loaded = _trainer()
    with pytest.warns(RuntimeWarning, match="corruption in it cannot be detected"):
        assert cw.same(odist.checkpoint.load(path, loaded, allow_unverified=True), POSITION)
    assert cw.same(_snapshot(loaded), _snapshot(t))


def test_save_writes_a_manifest_of_every_file(group: None, tmp_path: Path) -> None:
    path = odist.checkpoint.save(tmp_path, _trained())
    listed = files.read_manifest(path)
    assert listed is not None and sorted(listed) == sorted(p.name for p in path.iterdir() if p.name != files.MANIFEST)
    assert {".metadata", "__0_0.distcp"} <= set(listed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a verified folder: no warning
        assert odist.checkpoint.latest(tmp_path) == path


def test_save_keeps_the_folder_it_just_wrote(group: None, tmp_path: Path) -> None:
    # A run resumed from an older step because the newest folder was corrupt: its next save must stay
    # (keep=1 removed it before: the corrupt newer folder counted as the newest), the newer folder is
    # left for the user to look at, and an older incomplete one is removed.
    t = _trained(1)
    newer = tmp_path / "step_00000009"
    shutil.copytree(odist.checkpoint.save(tmp_path / "elsewhere", t), newer)
    _flip(newer / "__0_0.distcp", 100)
    (tmp_path / "step_00000000").mkdir()
    path = odist.checkpoint.save(tmp_path, t, keep=1)
    assert path.is_dir() and newer.is_dir() and not (tmp_path / "step_00000000").exists()
    found, warned = _latest(tmp_path)
    assert found == path and "step_00000009 (checksum mismatch in __0_0.distcp" in warned


# --- the fuzz -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["O0", "O2_bf16"])
def test_fuzz_flipped_bytes_raise_or_restore_exactly(group: None, tmp_path: Path, policy: str) -> None:
    pol = "O0" if policy == "O0" else Policy(opt_level="O2", dtype=torch.bfloat16)
    saved = _trained(policy=pol)
    pristine = odist.checkpoint.save(tmp_path / "pristine", saved, position=POSITION)
    ref = _snapshot(saved)
    rng = random.Random(18)
    flips = [(name, rng.randrange((pristine / name).stat().st_size), rng.randrange(1, 256))
             for name in (files.METADATA, "__0_0.distcp", files.MANIFEST) for _ in range(8)]
    outcomes = []
    for i, (name, pos, mask) in enumerate(flips):
        path = tmp_path / f"flip{i}" / pristine.name
        shutil.copytree(pristine, path)
        _flip(path / name, pos, mask)
        loaded = _trainer(pol)
        try:
            position = odist.checkpoint.load(path, loaded)
        except UsageError as exc:
            assert "\n" not in str(exc) and name.lstrip(".").split(".")[0] in str(exc), (name, pos, str(exc))
            outcomes.append("refused")
            continue
        # loaded: then exactly the saved state, never another one
        assert cw.same(position, POSITION) and cw.same(_snapshot(loaded), ref), (name, pos, mask)
        outcomes.append("same")
    assert outcomes.count("refused") == len(flips)  # every flip changes a checked byte


def test_fuzz_unverified_metadata_raises_only_usage_errors(group: None, tmp_path: Path) -> None:
    # Without a manifest nothing can tell a changed value from a saved one, but a damaged .metadata
    # still goes through the restricted unpickler: a UsageError or a load, never another exception.
    pristine = odist.checkpoint.save(tmp_path / "pristine", _trained(), position=POSITION)
    (pristine / files.MANIFEST).unlink()
    size = (pristine / files.METADATA).stat().st_size
    rng = random.Random(7)
    outcomes = []
    for i in range(24):
        path = tmp_path / f"flip{i}" / pristine.name
        shutil.copytree(pristine, path)
        _flip(path / files.METADATA, rng.randrange(size), rng.randrange(1, 256))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                odist.checkpoint.load(path, _trainer(), allow_unverified=True)
                outcomes.append("loaded")
            except UsageError as exc:
                assert "\n" not in str(exc)
                outcomes.append("refused")
    assert "refused" in outcomes
