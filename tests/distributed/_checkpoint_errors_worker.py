"""Run under torchrun with 2 ranks (gloo): checkpoint fixes that only show with several ranks.

- DDP with accumulate=2 saved mid-accumulation: each rank's partial gradients are local until the
  last micro-batch, so each rank must get its own back; the resume is compared with the same run
  uninterrupted (bit-identical expected: the same float ops in the same order).
- A trainer that already holds a stray micro-batch's gradients loads the same checkpoint.
- The ``position`` dict (nested, with a generator-state tensor) comes back unchanged.
- FSDP2 refuses a save mid-accumulation on every rank (no hang, nothing written).
- A checkpoint that does not fit raises the UsageError on every rank.
- A flipped byte in rank 1's shard (hashed by rank 1 only) raises the UsageError on every rank.

Each rank writes ``$OUT/results_rank<r>.json``: a number or string per check, or the error it raised.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import _numerics_worker as w  # noqa: E402

from overdrive import distributed as odist  # noqa: E402
from overdrive._utils.errors import UsageError  # noqa: E402
from overdrive.amp import Policy  # noqa: E402
from overdrive.train import Trainer  # noqa: E402

POSITION = {"sampler": {"epoch": 0, "consumed": 24}, "gen": torch.Generator().manual_seed(7).get_state(), "seen": [1, 2]}


def same(a: Any, b: Any) -> bool:
    """Equal in type, nesting and value (tensors: dtype and every element)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def main() -> None:
    out, rank, world, base, batches = w.start(120)
    micro = [mb for b in batches for mb in w.shard(b, rank, world, 2)]  # 6 micro-batches = 3 optimizer steps
    res: dict[str, Any] = {"world_size": world}

    def mk(strategy: str, policy: Any) -> Trainer:
        model = copy.deepcopy(base)
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), policy=policy, progress=False,
                       strategy=strategy, accumulate=2)

    def check(key: str, fn: Callable[[], Any]) -> None:
        # Record a failure and go on, so each test reports its own check (DCP raises on every rank alike).
        try:
            res[key] = fn()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            res[key] = f"{type(exc).__name__}: {str(exc)[:300]}"

    for name, policy in (("o0", "O0"), ("o2_bf16", Policy(opt_level="O2", dtype=torch.bfloat16))):
        whole = mk("ddp", policy)
        for mb in micro:
            whole.train_step(mb)
        ref = w.params(whole.model)
        root = out / f"mid_{name}"

        def resume() -> float:
            first = mk("ddp", policy)
            for mb in micro[:3]:  # mid-accumulation: step 1 done, one micro-batch of step 2 pending
                first.train_step(mb)
            odist.checkpoint.save(root, first)
            second = mk("ddp", policy)
            odist.checkpoint.load(odist.checkpoint.latest(root), second)
            for mb in micro[3:]:
                second.train_step(mb)
            return w.maxdiff(w.params(second.model), ref)

        def dirty_load() -> float:
            dirty = mk("ddp", policy)
            dirty.train_step(micro[5])  # a stray micro-batch: its gradients must not reach the resumed step
            odist.checkpoint.load(odist.checkpoint.latest(root), dirty)
            for mb in micro[3:]:
                dirty.train_step(mb)
            return w.maxdiff(w.params(dirty.model), ref)

        check(f"mid_accum_ddp_{name}", resume)
        check(f"dirty_load_ddp_{name}", dirty_load)

    def position() -> bool:
        t = mk("ddp", "O0")
        odist.checkpoint.save(out / "position", t, position=POSITION)
        return same(odist.checkpoint.load(odist.checkpoint.latest(out / "position"), mk("ddp", "O0")), POSITION)

    check("position", position)

    def fsdp_mid_save() -> str:
        fsdp = mk("fsdp", "O0")
        fsdp.train_step(micro[0])
        try:
            odist.checkpoint.save(out / "fsdp_mid", fsdp)
            return "saved"
        except UsageError as exc:
            return str(exc)

    check("fsdp_mid_save", fsdp_mid_save)
    dist.barrier()
    res["fsdp_mid_written"] = (out / "fsdp_mid").exists()

    def mismatch() -> str:
        other = nn.Sequential(nn.Linear(8, 5))
        t = Trainer(other, torch.optim.SGD(other.parameters(), lr=0.5), progress=False, strategy="ddp")
        try:
            odist.checkpoint.load(odist.checkpoint.latest(out / "mid_o0"), t)
            return "loaded"
        except UsageError as exc:
            return str(exc)

    check("mismatch", mismatch)

    def corrupt_shard() -> str:
        # Rank 1's shard, hashed by rank 1 alone (the ranks split the hashing): every rank must raise.
        path = odist.checkpoint.latest(out / "position")
        dist.barrier()  # every rank has its path before the shard changes (latest would skip it after)
        if rank == 0:
            shard = path / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x40
            shard.write_bytes(bytes(data))
        dist.barrier()
        try:
            odist.checkpoint.load(path, mk("ddp", "O0"))
            return "loaded"
        except UsageError as exc:
            return str(exc)

    check("corrupt_shard", corrupt_shard)

    (out / f"results_rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    # every rank's results are written; leave without gloo's shutdown, which can abort a rank ("terminate
    # called without an active exception") or hang it after its peer exits under a loaded suite
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
