"""Run under torchrun with 2 ranks (gloo): DDP / accumulation / FSDP2 / checkpoint numerics.

Each check compares against a single-process full-batch reference computed on every rank from
the same seed, and rank 0 writes max abs differences to ``$OUT_DIR/results.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from overdrive import distributed as odist
from overdrive.train import Trainer


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)) for _ in range(steps)]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(q.detach()).float().clone() for n, q in model.named_parameters()}


def masters(t: Trainer) -> dict[str, torch.Tensor]:
    """The fp32 weights a trainer steps, by parameter name: amp's masters at O2, else the (sharded) parameters."""
    of = {id(h): m for h, m in t.mp.master_pairs()}
    return {n: full(of.get(id(q), q).detach()).float().clone() for n, q in t.model.named_parameters()}


def maxdiff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def reference(base: nn.Module, batches: list, lr: float, momentum: float) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return params(model)


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int, micro: int = 1) -> list:
    x, y = batch
    n = x.shape[0] // world
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    return list(zip(x.chunk(micro), y.chunk(micro)))


def train(base: nn.Module, strategy: str | None, batches: list, rank: int, world: int, policy="O0", accumulate: int = 1,
          lr: float = 0.5, momentum: float = 0.9) -> Trainer:
    model = copy.deepcopy(base)
    t = Trainer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), policy=policy, progress=False,
                strategy=strategy, accumulate=accumulate)
    for b in batches:
        for mb in shard(b, rank, world, accumulate):
            t.train_step(mb)
    return t


def start(hang_s: int) -> tuple[Path, int, int, nn.Module, list]:
    """A worker's start: (output folder, rank, world size, the seeded Net, 3 batches of 16) on gloo; a hang past
    ``hang_s`` seconds dumps the stacks and exits, so the test fails instead of hanging."""
    import faulthandler

    faulthandler.dump_traceback_later(hang_s, exit=True)
    env = odist.init(backend="gloo", device="cpu")
    torch.manual_seed(0)
    return Path(sys.argv[1]), env.rank, env.world_size, Net(), data(3, 16)


def fp8_checks(res: dict[str, float], base: nn.Module, batches: list, rank: int, world: int, bf16, out: Path) -> None:
    """O2 bf16 + fp8 (emulated: fp32 GEMMs on fp8-rounded operands) under DDP and FSDP2 against the same policy in a
    single process that accumulates the ranks' halves of each batch as two micro-batches (each rank's activations
    get their own fp8 scales, as on the ranks); torchao needed (else no fp8 keys, and the test says so)."""
    from overdrive import amp
    from overdrive.amp import fp8 as fp8_mod

    if not fp8_mod.is_available():
        return
    batches = data(3, 16 * 2 * world)  # 16 tokens per rank and micro-batch: fp8 GEMMs need multiples of 16
    rule = amp.Fp8(emulate=True, min_features=0, min_weight=0)  # the 16x16 blocks: a size rule would keep them bf16
    policy = amp.Policy(opt_level="O2", dtype=torch.bfloat16, fp8=rule)
    one = batches[:1]  # one plain SGD step: later steps amplify a bf16 rounding into a flipped fp8 rounding
    kw = dict(policy=policy, lr=1.0, momentum=0.0)
    ref_t = train(base, None, one, 0, 1, accumulate=world, **kw)  # micro-batch k = rank k's half
    ref = masters(ref_t)
    ddp = train(base, "ddp", one, rank, world, **kw)
    fsdp = train(base, "fsdp", one, rank, world, **kw)
    res["fp8_ref_layers"] = float(len(fp8_mod.fp8_modules(ref_t.model)))
    res["ddp_fp8_layers"] = float(len(fp8_mod.fp8_modules(ddp.model)))
    res["fsdp_fp8_layers"] = float(len(fp8_mod.fp8_modules(fsdp.model)))
    res["fsdp_fp8_all_gather"] = float(all(type(q._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
                                           for m in fp8_mod.fp8_modules(fsdp.model) for q in [m.weight]))
    res["ddp_fp8"] = maxdiff(masters(ddp), ref)
    # FSDP2 at O2 holds fp32 shards and computes in bf16 (amp O1's numerics): fp8 casts the fp32 weights
    o1 = amp.Policy(opt_level="O1", dtype=torch.bfloat16, fp8=rule)
    res["fsdp_fp8"] = maxdiff(masters(fsdp), masters(train(base, None, one, 0, 1, accumulate=world,
                                                           **dict(kw, policy=o1))))
    bf16_kw = dict(kw, policy=bf16)
    res["fp8_vs_bf16"] = maxdiff(ref, masters(train(base, None, one, 0, 1, accumulate=world, **bf16_kw)))
    # FSDP2 + fp8 checkpoint (fp8 all-gather weights) -> resume == uninterrupted
    whole = train(base, "fsdp", batches, rank, world, policy=policy)
    first = train(base, "fsdp", batches[:2], rank, world, policy=policy)
    root = os.path.join(out, "ckpt_fsdp_fp8")
    odist.checkpoint.save(root, first, position={"consumed": 2 * len(batches[0][0]), "epoch": 0})
    model = copy.deepcopy(base)
    second = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), policy=policy, progress=False,
                     strategy="fsdp")
    odist.checkpoint.load(odist.checkpoint.latest(root), second)
    for mb in shard(batches[2], rank, world):
        second.train_step(mb)
    res["resume_fsdp_fp8"] = maxdiff(masters(second), masters(whole))


def main() -> None:
    out, rank, world, base, batches = start(60)
    ref = reference(base, batches, 0.5, 0.9)
    res: dict[str, float] = {"world_size": world}

    res["ddp"] = maxdiff(params(train(base, "ddp", batches, rank, world).model), ref)
    res["ddp_static"] = maxdiff(params(train(base, "ddp_static", batches, rank, world).model), ref)
    res["ddp_accumulate2"] = maxdiff(params(train(base, "ddp", batches, rank, world, accumulate=2).model), ref)
    t_fsdp = train(base, "fsdp", batches, rank, world)
    res["fsdp"] = maxdiff(params(t_fsdp.model), ref)
    res["fsdp_is_sharded"] = float(all(hasattr(q, "full_tensor") for q in t_fsdp.model.parameters()))
    res["fsdp_accumulate2"] = maxdiff(params(train(base, "fsdp", batches, rank, world, accumulate=2).model), ref)
    # Gradient scale alone (pytorch#162338: AVG on gloo): one step of plain SGD, lr 1, no momentum.
    one = batches[:1]
    res["fsdp_grad_scale"] = maxdiff(params(train(base, "fsdp", one, rank, world, lr=1.0, momentum=0.0).model),
                                     reference(base, one, 1.0, 0.0))
    bf16 = __import__("overdrive").amp.Policy(opt_level="O2", dtype=torch.bfloat16)
    res["fsdp_o2_bf16"] = maxdiff(params(train(base, "fsdp", batches, rank, world, policy=bf16).model), ref)
    res["ddp_o2_bf16"] = maxdiff(params(train(base, "ddp", batches, rank, world, policy=bf16).model), ref)

    fp8_checks(res, base, batches, rank, world, bf16, out)

    # Checkpoint / resume == uninterrupted, for DDP (O2 bf16: masters + scaler) and FSDP.
    for strategy, policy in (("ddp", bf16), ("fsdp", "O0")):
        whole = train(base, strategy, batches, rank, world, policy=policy)
        first = train(base, strategy, batches[:2], rank, world, policy=policy)
        root = os.path.join(out, f"ckpt_{strategy}")
        odist.checkpoint.save(root, first, position={"consumed": 32, "epoch": 0})
        model = copy.deepcopy(base)
        second = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), policy=policy, progress=False,
                         strategy=strategy)
        pos = odist.checkpoint.load(odist.checkpoint.latest(root), second)
        assert pos == {"consumed": 32, "epoch": 0}, pos
        assert second.step_count == 2, second.step_count
        for mb in shard(batches[2], rank, world):
            second.train_step(mb)
        whole_params = params(whole.model)
        res[f"resume_{strategy}"] = maxdiff(params(second.model), whole_params)
        if rank == 0:
            torch.save(whole_params, os.path.join(out, f"whole_{strategy}.pt"))
    step2 = params(first.model)  # full_tensor() is a collective: every rank calls it
    if rank == 0:
        torch.save(step2, os.path.join(out, "fsdp_step2_params.pt"))
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(res, f)
    dist.barrier()
    # every rank's results are written; leave without gloo's shutdown, which can abort a rank ("terminate
    # called without an active exception") or hang it after its peer exits under a loaded suite
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
