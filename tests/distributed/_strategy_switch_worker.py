"""Run under torchrun with 2 ranks (gloo): checkpoints that move between DDP and FSDP2, and fit's
partial accumulation at epoch end under both strategies.

- A checkpoint saved under one strategy (AdamW, so the optimizer has state) loads under the other,
  and the next step equals the saving strategy's uninterrupted run.
- DDP O2 bf16 (optimizer over amp's masters) into FSDP2 O2 bf16: a UsageError on every rank, no hang.
- Saving with an optimizer that has not stepped leaves the run unchanged (get_state_dict used to
  step it once with lr 0: Adam's step count became 1), and the checkpoint loads into a fresh trainer.
- fit with accumulate=2 over 3 micro-batches per rank: the last, partial accumulation is stepped on
  its mean gradient, compared with plain single-process SGD on the full batches.

Each rank writes ``$OUT/results_rank<r>.json``: a number per check, or the error it raised.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
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

BF16 = Policy(opt_level="O2", dtype=torch.bfloat16)


def main() -> None:
    out, rank, world, base, batches = w.start(120)
    mine = [w.shard(b, rank, world)[0] for b in batches]  # this rank's half of each batch
    res: dict[str, Any] = {"world_size": world}

    def mk(strategy: str, policy: Any = "O0", accumulate: int = 1, sgd: bool = False) -> Trainer:
        model = copy.deepcopy(base)
        opt = (torch.optim.SGD(model.parameters(), lr=0.5) if sgd else torch.optim.AdamW(model.parameters(), lr=1e-2))
        return Trainer(model, opt, policy=policy, progress=False, strategy=strategy, accumulate=accumulate)

    def check(key: str, fn: Callable[[], Any]) -> None:
        try:
            res[key] = fn()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            res[key] = f"{type(exc).__name__}: {str(exc)[:400]}"

    for src, dst in (("ddp", "fsdp"), ("fsdp", "ddp")):
        def switch(src: str = src, dst: str = dst) -> float:
            whole = mk(src)
            for mb in mine:
                whole.train_step(mb)
            first = mk(src)
            for mb in mine[:2]:
                first.train_step(mb)
            root = out / f"{src}_to_{dst}"
            odist.checkpoint.save(root, first)
            second = mk(dst)
            odist.checkpoint.load(odist.checkpoint.latest(root), second)
            assert second.step_count == 2, second.step_count
            second.train_step(mine[2])
            return w.maxdiff(w.params(second.model), w.params(whole.model))

        check(f"{src}_to_{dst}", switch)

    def o2_ddp_to_fsdp() -> str:
        first = mk("ddp", BF16)
        first.train_step(mine[0])
        odist.checkpoint.save(out / "o2_ddp", first)
        try:
            odist.checkpoint.load(odist.checkpoint.latest(out / "o2_ddp"), mk("fsdp", BF16))
            return "loaded"
        except UsageError as exc:
            return str(exc)

    check("o2_ddp_to_fsdp", o2_ddp_to_fsdp)

    for strategy in ("ddp", "fsdp"):
        def fresh_save(strategy: str = strategy) -> list[float]:
            plain, saved = mk(strategy), mk(strategy)
            root = out / f"fresh_{strategy}"
            odist.checkpoint.save(root, saved)  # before the first step
            loaded = mk(strategy)
            odist.checkpoint.load(odist.checkpoint.latest(root), loaded)
            for t in (plain, saved, loaded):
                for mb in mine:
                    t.train_step(mb)
            ref = w.params(plain.model)
            return [w.maxdiff(w.params(saved.model), ref), w.maxdiff(w.params(loaded.model), ref)]

        check(f"fresh_save_{strategy}", fresh_save)

    # Reference for fit: plain SGD (lr 0.5) on the full batches, the third batch alone in the last step.
    ref_model = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    for window in (batches[:2], batches[2:]):
        ref_opt.zero_grad()
        (sum(nn.functional.cross_entropy(ref_model(x), y) for x, y in window) / len(window)).backward()
        ref_opt.step()
    ref = w.params(ref_model)
    for strategy in ("ddp", "fsdp"):
        def fit_partial(strategy: str = strategy) -> float:
            t = mk(strategy, accumulate=2, sgd=True)
            t.fit(mine, epochs=1)
            assert t.step_count == 2, t.step_count
            return w.maxdiff(w.params(t.model), ref)

        check(f"fit_partial_{strategy}", fit_partial)

    (out / f"results_rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    # every rank's results are written; leave without gloo's shutdown, which can abort a rank ("terminate
    # called without an active exception") or hang it after its peer exits under a loaded suite
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
