"""overdrive.distributed.checkpoint errors and edge cases, each with a test that failed before its fix:

1. a checkpoint that does not fit the trainer raises the UsageError (DCP's CheckpointException
   derives from BaseException and escaped ``except Exception``);
2. save/load mid-accumulation keep each rank's pending gradients, and load drops gradients the
   trainer already holds (resume = uninterrupted run, bit-identical); FSDP2, whose partial
   gradients live in its private state, refuses both cases with a UsageError;
3. load returns the saved ``position`` unchanged (nesting and tensors);
4. a checkpoint saved under DDP loads under FSDP2 and back (the optimizer state is stored by
   parameter name for both), O2/O3 mismatches are refused naming both strategies before anything
   is loaded, and a save before the first step leaves the optimizer fresh; plus ``Trainer.fit``'s
   partial accumulation at epoch end under both strategies (``_strategy_switch_worker.py``);
5. a flipped byte in one rank's shard is refused on every rank (the rest of issue 18's checks,
   single-process, are in ``test_checkpoint_integrity.py``).

Single-process checks run in a process group of one; the per-rank ones run 2 gloo ranks under
torchrun (``_checkpoint_errors_worker.py``).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from overdrive import distributed as odist
from overdrive._utils.errors import UsageError
from overdrive.amp import Policy
from overdrive.distributed import LaunchConfig
from overdrive.distributed.launch import launch
from overdrive.train import Trainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _rank_env import worker_env  # noqa: E402

import _checkpoint_errors_worker as cw  # noqa: E402
import _numerics_worker as w  # noqa: E402

POLICIES = {"O0": "O0", "O2_bf16": Policy(opt_level="O2", dtype=torch.bfloat16)}


def _micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(n)]


def _trainer(base: nn.Module, policy: Any = "O0", strategy: str | None = None, accumulate: int = 2) -> Trainer:
    model = copy.deepcopy(base)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), policy=policy, progress=False,
                   strategy=strategy, accumulate=accumulate)


def _base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))


def _net() -> nn.Module:
    """The blocks model FSDP2 shards block by block."""
    torch.manual_seed(0)
    return w.Net()


# --- 1. a checkpoint that does not fit ------------------------------------------------------
@pytest.mark.parametrize(("other", "names"), [
    (lambda: nn.Sequential(nn.Linear(4, 3)), "0.weight"),  # different parameter names
    (lambda: nn.Linear(4, 5), "Size mismatch"),  # same names, other shapes
])
def test_load_that_does_not_fit_raises_usage_error(group: None, tmp_path: Path, other: Any, names: str) -> None:
    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    t.train_step((torch.randn(8, 4), torch.randint(0, 3, (8,))))
    odist.checkpoint.save(tmp_path, t)
    m2 = other()
    t2 = Trainer(m2, torch.optim.SGD(m2.parameters(), lr=0.1), progress=False)
    with pytest.raises(UsageError, match="does not fit this trainer") as info:
        odist.checkpoint.load(odist.checkpoint.latest(tmp_path), t2)
    msg = str(info.value)
    # one line naming the cause, not DCP's per-rank tracebacks
    assert names in msg and "\n" not in msg and "Traceback" not in msg and "same model" in msg


# --- 2. gradient accumulation ---------------------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_save_mid_accumulation_resumes_like_uninterrupted(group: None, tmp_path: Path, policy: str) -> None:
    base, mbs = _base(), _micro_batches(4)
    whole = _trainer(base, POLICIES[policy])
    for mb in mbs:
        whole.train_step(mb)
    first = _trainer(base, POLICIES[policy])
    for mb in mbs[:3]:  # step 1 done, micro-batch 3 pending
        first.train_step(mb)
    odist.checkpoint.save(tmp_path, first)
    second = _trainer(base, POLICIES[policy])
    odist.checkpoint.load(odist.checkpoint.latest(tmp_path), second)
    assert (second.step_count, second._micro) == (1, 3)
    second.train_step(mbs[3])
    # Reference: the uninterrupted run; the same ops on the same values, so bit-identical.
    assert w.maxdiff(w.params(second.model), w.params(whole.model)) == 0.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_load_drops_gradients_the_trainer_already_holds(group: None, tmp_path: Path, policy: str) -> None:
    base, mbs = _base(), _micro_batches(6)
    first = _trainer(base, POLICIES[policy])
    for mb in mbs[:2]:
        first.train_step(mb)
    odist.checkpoint.save(tmp_path, first)
    clean = _trainer(base, POLICIES[policy])
    odist.checkpoint.load(odist.checkpoint.latest(tmp_path), clean)
    dirty = _trainer(base, POLICIES[policy])
    dirty.train_step(mbs[5])  # a stray micro-batch's gradients, half an accumulation
    odist.checkpoint.load(odist.checkpoint.latest(tmp_path), dirty)
    for t in (clean, dirty):
        for mb in mbs[2:4]:
            t.train_step(mb)
    # Reference: the same checkpoint loaded into a fresh trainer.
    assert w.maxdiff(w.params(dirty.model), w.params(clean.model)) == 0.0


def test_fsdp_refuses_save_mid_accumulation(group: None, tmp_path: Path) -> None:
    t = _trainer(_net(), strategy="fsdp")
    t.train_step(_micro_batches(1)[0])
    with pytest.raises(UsageError, match=r"micro-batch 1 of accumulate=2 under strategy='fsdp'.*after the train_step"):
        odist.checkpoint.save(tmp_path, t)
    assert not any(tmp_path.iterdir())  # nothing written


def test_fsdp_refuses_load_into_trainer_mid_accumulation(group: None, tmp_path: Path) -> None:
    base, mbs = _net(), _micro_batches(3)
    first = _trainer(base, strategy="fsdp")
    for mb in mbs[:2]:
        first.train_step(mb)
    odist.checkpoint.save(tmp_path, first)
    dirty = _trainer(base, strategy="fsdp")
    dirty.train_step(mbs[2])  # FSDP2 keeps these unsharded, where load cannot drop them
    with pytest.raises(UsageError, match=r"micro-batch 1 of accumulate=2 under strategy='fsdp'.*freshly built Trainer"):
        odist.checkpoint.load(odist.checkpoint.latest(tmp_path), dirty)
    fresh = _trainer(base, strategy="fsdp")  # the documented way still works
    odist.checkpoint.load(odist.checkpoint.latest(tmp_path), fresh)
    assert fresh.step_count == 1


# --- 3. position ----------------------------------------------------------------------------
@pytest.mark.parametrize("position", [
    {"epoch": 1, "consumed": 32},
    {"train": {"epoch": 1, "consumed": 32}, "note": "x"},
    {"seen": [1, 2, 3], "rng": torch.Generator().manual_seed(3).get_state(), "pair": (1, 2.5)},
    {},
], ids=["flat", "nested", "tensors", "empty"])
def test_load_returns_position_unchanged(group: None, tmp_path: Path, position: dict) -> None:
    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    odist.checkpoint.save(tmp_path, t, position=position)
    m2 = nn.Linear(4, 3)
    got = odist.checkpoint.load(odist.checkpoint.latest(tmp_path), Trainer(m2, torch.optim.SGD(m2.parameters(), lr=0.1), progress=False))
    assert cw.same(got, position), got


@pytest.mark.parametrize(("position", "match"), [([1, 2], "expected a dict"), ({"obj": object()}, "weights_only")])
def test_save_refuses_position_it_cannot_restore(group: None, tmp_path: Path, position: Any, match: str) -> None:
    model = nn.Linear(4, 3)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    with pytest.raises(UsageError, match=match):
        odist.checkpoint.save(tmp_path, t, position=position)
    assert not any(tmp_path.iterdir())


# --- two ranks ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("ckpt_fixes")
    rc = launch(LaunchConfig(nproc_per_node=2), str(HERE / "_checkpoint_errors_worker.py"), [str(out)], env=worker_env(), timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)], out


@pytest.mark.parametrize("policy", ["o0", "o2_bf16"])
def test_two_ranks_ddp_mid_accumulation_resume_equals_uninterrupted(two_ranks: tuple[list[dict], Path], policy: str) -> None:
    for res in two_ranks[0]:
        assert res["world_size"] == 2
        # Reference: the same 2-rank DDP run uninterrupted; bit-identical expected.
        assert res[f"mid_accum_ddp_{policy}"] == 0.0
        assert res[f"dirty_load_ddp_{policy}"] == 0.0


def test_two_ranks_position_comes_back_unchanged(two_ranks: tuple[list[dict], Path]) -> None:
    for res in two_ranks[0]:
        assert res["position"] is True, res["position"]


def test_two_ranks_fsdp_save_mid_accumulation_refused_on_every_rank(two_ranks: tuple[list[dict], Path]) -> None:
    for res in two_ranks[0]:
        assert "strategy='fsdp'" in res["fsdp_mid_save"] and res["fsdp_mid_written"] is False


def test_two_ranks_mismatch_raises_usage_error_on_every_rank(two_ranks: tuple[list[dict], Path]) -> None:
    for res in two_ranks[0]:
        assert "does not fit this trainer" in res["mismatch"] and "Traceback" not in res["mismatch"]


def test_two_ranks_corrupt_shard_of_one_rank_is_refused_on_every_rank(two_ranks: tuple[list[dict], Path]) -> None:
    # Loaded silently before (no checksums); rank 1 alone hashes its shard, and both ranks raise.
    for res in two_ranks[0]:
        assert "checksum mismatch in __1_0.distcp" in res["corrupt_shard"], res["corrupt_shard"]


def test_mid_accumulation_checkpoint_needs_its_rank_count(two_ranks: tuple[list[dict], Path], group: None) -> None:
    t = _trainer(_net(), strategy="ddp")
    with pytest.raises(UsageError, match=r"mid-accumulation on 2 rank\(s\).*this run has 1"):
        odist.checkpoint.load(odist.checkpoint.latest(two_ranks[1] / "mid_o0"), t)


# --- 4. checkpoints move between DDP and FSDP2 (failed before: "Missing key in checkpoint") ----
def test_checkpoint_saved_by_an_earlier_overdrive_still_loads(group: None, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Earlier versions stored a DDP / no-strategy optimizer as one object at every amp level.
    base, mbs = _base(), _micro_batches(3)
    whole = _trainer(base, accumulate=1)
    for mb in mbs:
        whole.train_step(mb)
    first = _trainer(base, accumulate=1)
    for mb in mbs[:2]:
        first.train_step(mb)
    with monkeypatch.context() as m:
        m.setattr(odist.checkpoint, "_named_optim", lambda trainer: False)
        odist.checkpoint.save(tmp_path, first)
    second = _trainer(base, accumulate=1)
    odist.checkpoint.load(odist.checkpoint.latest(tmp_path), second)
    second.train_step(mbs[2])
    assert w.maxdiff(w.params(second.model), w.params(whole.model)) == 0.0


def test_amp_level_that_differs_between_strategies_is_named_before_loading(group: None, tmp_path: Path) -> None:
    base = _net()
    first = _trainer(base, POLICIES["O2_bf16"], strategy="fsdp", accumulate=1)  # amp O0 over fp32 shards
    first.train_step(_micro_batches(1)[0])
    odist.checkpoint.save(tmp_path, first)
    o1 = _trainer(base, Policy(opt_level="O1", dtype=torch.bfloat16), strategy="ddp", accumulate=1)
    before = w.params(o1.model)
    with pytest.raises(UsageError, match=r"opt level 'O0'.*strategy='ddp'.*'O1'.*strategy='fsdp' runs O2/O3"):
        odist.checkpoint.load(odist.checkpoint.latest(tmp_path), o1)
    assert w.maxdiff(w.params(o1.model), before) == 0.0  # nothing was loaded


@pytest.fixture(scope="module")
def switch_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("strategy_switch")
    rc = launch(LaunchConfig(nproc_per_node=2), str(HERE / "_strategy_switch_worker.py"), [str(out)], env=worker_env(), timeout_s=600)
    assert rc == 0, f"torchrun exit code {rc}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("switch", ["ddp_to_fsdp", "fsdp_to_ddp"])
def test_two_ranks_checkpoint_loads_under_the_other_strategy(switch_ranks: list[dict], switch: str) -> None:
    for res in switch_ranks:
        assert res["world_size"] == 2
        # Reference: the saving strategy's uninterrupted run (AdamW state moved); bit-identical on gloo.
        assert res[switch] == 0.0


def test_two_ranks_o2_ddp_checkpoint_into_fsdp_is_refused_naming_both(switch_ranks: list[dict]) -> None:
    for res in switch_ranks:
        msg = res["o2_ddp_to_fsdp"]
        assert "strategy='ddp'/none at O2" in msg and "this trainer (strategy='fsdp'" in msg, msg


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_save_before_the_first_step_changes_nothing(switch_ranks: list[dict], strategy: str) -> None:
    # FSDP2 failed before: get_state_dict stepped the fresh AdamW once (step count 1).
    for res in switch_ranks:
        assert res[f"fresh_save_{strategy}"] == [0.0, 0.0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_fit_steps_the_partial_accumulation_at_epoch_end(switch_ranks: list[dict], strategy: str) -> None:
    for res in switch_ranks:
        # Reference: single-process SGD on the full batches, the last one alone; fp32 tolerance.
        assert res[f"fit_partial_{strategy}"] < 1e-6
