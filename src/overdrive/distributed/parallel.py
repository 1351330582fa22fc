"""DDP and FSDP2 on a model + optimizer + amp policy; the process group from torchrun's environment.

Order matters and is kept here, out of the training loop:
  - DDP: amp casts the model first (O2/O3 half weights), then DDP wraps it, so its buckets hold
    the dtype the backward produces.
  - FSDP2: ``fully_shard`` first (parameters become DTensor shards, so the optimizer is rebuilt on
    them), with a ``MixedPrecisionPolicy`` derived from the amp level; amp then runs at O0 (bf16
    O2/O3: FSDP holds fp32 shards = the masters, computes in bf16) or O1 (autocast, fp32 params).
  - fp8 (``Policy.fp8``): DDP: amp swaps the chosen Linear layers for fp8 ones, then DDP wraps as above.
    FSDP2: the swap happens here, before ``fully_shard`` (the fp8 rule would be lost with the O0 that
    remains); with the tensorwise recipe the weights are all-gathered in fp8 (half bf16's bytes) and
    :meth:`Parallel.after_step` computes the next step's weight scales in one all-reduce.

Gradient accumulation: amp keeps each micro-batch's gradients aside while the next backward runs
(exact unscaling), so DDP's reducer would only see the last micro-batch. Under DDP the loop runs
every micro-batch in ``no_sync`` and :meth:`Parallel.finish_accumulation` all-reduces the
accumulated optimizer gradients once, bucketed. FSDP2 accumulates unsharded gradients itself and
reduce-scatters on the last micro-batch.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive.amp import Policy
from overdrive.distributed import slurm
from overdrive.distributed.config import Strategy


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job (from torchrun's RANK / WORLD_SIZE / LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# where launchers other than torchrun put a process's rank on its node (Open MPI, MPICH/Intel MPI, Slurm's srun)
LOCAL_RANK_FALLBACKS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


# where MPI launchers put a process's rank and the job's process count: (rank, size, launcher)
MPI_RANK_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
                 ("PMI_RANK", "PMI_SIZE", "mpiexec (MPICH / Intel MPI)"),
                 ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "mpirun (MVAPICH)"))


def rank_env(environ: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """``environ`` with torchrun's RANK / WORLD_SIZE, taken from an MPI launcher's variables where torchrun's are unset
    (a job of several processes only), else from ``srun``'s tasks of one Slurm step (:func:`slurm.step_env`, which
    also fills an unset MASTER_ADDR / MASTER_PORT), and which launcher gave them (None: torchrun's, or a group of
    one). Under ``mpirun -np 4 python train.py`` or ``srun -n 4 python train.py`` without them every process joined
    a group of one and trained alone, each writing the same checkpoint files.

    Example:
        >>> env, who = rank_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"})
        >>> env["RANK"], env["WORLD_SIZE"], who
        ('1', '4', 'mpirun (Open MPI)')
    """
    if "WORLD_SIZE" in environ or "RANK" in environ:
        return environ, None
    # MPI's first: mpirun inside a Slurm allocation starts its daemons with srun, one task per node, so its
    # processes also carry that step's SLURM_PROCID (the node's index) and SLURM_STEP_NUM_TASKS (the node count)
    for rank, size, who in MPI_RANK_VARS:
        n = environ.get(size, "").strip()
        if rank in environ and n.isdigit() and int(n) > 1:
            return {**environ, "RANK": environ[rank].strip(), "WORLD_SIZE": n}, who
    step = slurm.step_env(environ)  # srun's tasks of one step; never the sbatch script, which has no step size
    if step is not None:
        return {**environ, **step}, slurm.LAUNCHER
    return environ, None


def _local_rank(world: int, cuda: bool) -> tuple[int, str | None]:
    """This process's rank on its node and the variable it came from: torchrun's LOCAL_RANK, else an MPI or Slurm
    launcher's. A job of several ranks on GPUs with none of them is refused (every rank would take cuda:0 and the GPUs
    past it would sit idle), unless each process sees one GPU only: its own, given to it by the launcher (a
    Kubernetes PyTorchJob pod per rank, ``srun --gpus-per-task=1``)."""
    for var in ("LOCAL_RANK", *LOCAL_RANK_FALLBACKS):
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var]), var
    if world > 1 and cuda and torch.cuda.device_count() != 1:
        raise UsageError(f"WORLD_SIZE={world} on CUDA but LOCAL_RANK is unset (nor {', '.join(LOCAL_RANK_FALLBACKS)}): "
                         "every rank would take cuda:0; start the script with `overdrive launch` / torchrun, which set "
                         "it, or set LOCAL_RANK to each process's rank on its node")
    return 0, None


def _gpu_index(local: int, var: str | None) -> int:
    """The CUDA device this rank takes: its local rank, or 0 where the process sees one GPU and its local rank comes
    from an MPI or Slurm launcher, which gives each process its own GPU (``srun --gpus-per-task=1``, ``--gpu-bind``):
    SLURM_LOCALID 3 with one visible GPU had been refused ("only 1 GPU(s) are visible")."""
    count = torch.cuda.device_count()
    if local < count:
        return local
    if count == 1 and var in LOCAL_RANK_FALLBACKS:
        return 0
    raise OverdriveError(f"{var or 'LOCAL_RANK'}={local} but only {count} GPU(s) are visible; lower --nproc-per-node "
                         "or check CUDA_VISIBLE_DEVICES")


def init(backend: str | None = None, device: str | torch.device | None = None) -> DistEnv:
    """Join the process group torchrun describes (or a group of one without torchrun).

    Started by ``mpirun`` / ``mpiexec`` instead (Open MPI, MPICH, Intel MPI, MVAPICH: no RANK / WORLD_SIZE), the rank
    and the process count are the launcher's (:func:`rank_env`); MASTER_ADDR and MASTER_PORT must then be given to
    every process (``mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500``), as torchrun would set them. Started by
    Slurm's ``srun`` with several tasks, they are the step's (SLURM_PROCID, SLURM_STEP_NUM_TASKS); an unset
    MASTER_ADDR is the step's first node and an unset MASTER_PORT is derived from the job and step ids
    (:func:`slurm.default_port`). The batch script itself (``python train.py`` under ``sbatch``) is a group of one.

    ``backend`` defaults to nccl when CUDA is available and the device is not 'cpu', else gloo.

    Example:
        >>> # env = overdrive.distributed.init(); model = ... .to(env.device)
    """
    from overdrive.distributed.doctor import master_host, rank_env_problems

    environ, launcher = rank_env(dict(os.environ))  # torchrun's RANK / WORLD_SIZE, else an MPI launcher's or srun's
    bad = rank_env_problems(environ)
    if bad:  # a RANK past WORLD_SIZE would wait out the store's timeout; a non-number is a bare ValueError
        raise UsageError("overdrive.distributed.init(): " + "; ".join(detail for _, detail in bad))
    rank = int(environ.get("RANK", "0"))
    world = int(environ.get("WORLD_SIZE", "1"))
    want_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    local, local_var = _local_rank(world, want_cuda)
    dev = torch.device("cuda", _gpu_index(local, local_var)) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if want_cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise UsageError(f"backend={backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU)")
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world}
        if "MASTER_PORT" not in environ:
            if world > 1 and launcher is not None:
                example = ("export MASTER_ADDR=<node 0> MASTER_PORT=29500 before srun" if launcher == slurm.LAUNCHER
                           else "mpirun -x MASTER_ADDR=<node 0> -x MASTER_PORT=29500 ...")
                raise UsageError(f"{launcher} started {world} processes, but MASTER_PORT is unset, so they cannot find "
                                 f"each other; give every process node 0's address and a free port (e.g. {example}), "
                                 "or start the script with `overdrive launch`")
            if world > 1:
                raise UsageError("WORLD_SIZE > 1 but MASTER_PORT is unset; start the script with `overdrive launch`")
            kwargs["init_method"] = f"tcp://127.0.0.1:{free_port()}"  # a group of one, without torchrun
        else:
            # One key space per torchrun attempt: after a restart, gloo could otherwise read the dead
            # round's addresses from the shared store and fail with "Connection refused".
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            derived = launcher == slurm.LAUNCHER and "MASTER_PORT" not in os.environ  # srun: the port from the job id
            if launcher == slurm.LAUNCHER and "MASTER_ADDR" not in os.environ and "MASTER_ADDR" in environ:
                slurm.check_master_host(environ)  # the address from the node list: task 0 must run there
            host = master_host(environ.get("MASTER_ADDR", "127.0.0.1"))  # [fd00::1] as the store reads it
            try:
                store = dist.TCPStore(host, int(environ["MASTER_PORT"]), world,
                                      is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                                      timeout=datetime.timedelta(seconds=300))
            except RuntimeError as exc:
                if not (derived and rank == 0):
                    raise
                raise UsageError(f"MASTER_PORT={environ['MASTER_PORT']} (derived from SLURM_JOB_ID / SLURM_STEP_ID) "
                                 f"cannot be opened on {environ.get('MASTER_ADDR')}: {(str(exc).splitlines() or [''])[0]}; "
                                 "export MASTER_PORT=<a free port> before srun") from exc
            kwargs["store"] = dist.PrefixStore(f"overdrive/attempt_{attempt}", store)
        if backend == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    return DistEnv(rank, world, local, dev, dist.get_backend())



def leave(code: int = 0) -> None:
    """End this rank's process once its results are written: a barrier (every rank gets here first), output
    flushed, then ``os._exit(code)``, without the process group's teardown. On a loaded machine gloo's teardown
    has aborted a rank ("terminate called without an active exception") or hung it once its peer had exited, which
    failed or stalled a run whose work was done. For worker scripts only: atexit handlers do not run.

    Example:
        >>> # env = init(); ...; atomic_write(out, results) if env.is_main else None; leave()
    """
    import sys

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

def free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsdp_mixed_precision(policy: Policy, device: torch.device) -> tuple[Any, Policy]:
    """The FSDP2 MixedPrecisionPolicy for an amp policy, and the amp policy that remains.

    O2/O3 bf16 -> param_dtype bf16, reduce_dtype fp32 (O2) / bf16 (O3), amp O0 (the fp32
    shards are the master weights). O1 -> no FSDP casting, amp O1 autocast on fp32 params.

    Example:
        >>> mpp, rest = fsdp_mixed_precision(Policy(opt_level="O2", dtype=torch.bfloat16), torch.device("cpu"))
        >>> mpp.param_dtype, rest.opt_level
        (torch.bfloat16, 'O0')
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = policy.resolve(device)
    if p.opt_level in ("O2", "O3"):
        if p.dtype != torch.bfloat16:
            raise UsageError(
                f"strategy='fsdp' at {p.opt_level} needs dtype bfloat16 (got {p.dtype}): fp16 would need a loss "
                "scaler over sharded gradients; use Policy(opt_level=..., dtype=torch.bfloat16) or O1"
            )
        reduce = torch.float32 if p.opt_level == "O2" else torch.bfloat16
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce), Policy(opt_level="O0")
    if p.opt_level == "O1" and p.dtype == torch.float16 and p.dynamic:
        raise UsageError("strategy='fsdp' with O1 fp16 needs a sharded loss scaler; use dtype=torch.bfloat16")
    return MixedPrecisionPolicy(), policy


def fsdp_blocks(model: nn.Module, class_names: tuple[str, ...] = ()) -> list[nn.Module]:
    """The modules to shard one by one: by class name if given, else the children of every
    ``nn.ModuleList`` / ``nn.Sequential`` (outermost containers first), else the root's children."""
    if class_names:
        blocks = [m for m in model.modules() if type(m).__name__ in class_names and m is not model]
        if not blocks:
            raise UsageError(f"fsdp_blocks={class_names} matched no module; class names here: "
                             f"{sorted({type(m).__name__ for m in model.modules()})[:20]}")
        # innermost first: FSDP2 shards bottom-up (an outer block sharded first took the inner one's parameters, and
        # sharding the inner one then failed inside torch with "Invariant encountered: value was None")
        return _untied(model, blocks[::-1])
    blocks: list[nn.Module] = []
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and id(m) not in seen:
            for c in m.children():
                if any(True for _ in c.parameters()):
                    blocks.append(c)
                for d in c.modules():
                    seen.add(id(d))
            for d in m.modules():
                seen.add(id(d))
    if not blocks:
        blocks = [c for c in model.children() if any(True for _ in c.parameters())]
    return _untied(model, blocks)


def _untied(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """``blocks`` less those holding a parameter that is also reached from outside them (tied weights: an embedding
    and the LM head that shares its weight). Those are left to the root's group, which then owns the shared tensor;
    sharded on their own, the second block failed ("shared with a parameter already managed by another FSDP group").

    Example:
        >>> emb, head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False); head.weight = emb.weight
        >>> m = nn.Sequential(emb, nn.Linear(4, 4), head)
        >>> [type(b).__name__ for b in _untied(m, list(m.children()))]
        ['Linear']
    """
    names: dict[int, list[str]] = {}
    for n, q in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(q), []).append(n)
    path = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    keep = []
    for b in blocks:
        prefix = path[id(b)] + "."
        if all(n.startswith(prefix) for q in b.parameters() for n in names[id(q)]):
            keep.append(b)
    return keep


def _rebind_optimizer(optimizer: torch.optim.Optimizer, old_to_name: dict[int, str], model: nn.Module) -> torch.optim.Optimizer:
    """Point ``optimizer``'s groups at the model's new (sharded) parameters, in place.

    The optimizer object stays the same, so an lr scheduler built on it and the caller's own reference keep
    working (a re-created optimizer left the scheduler driving the old one: the lr never changed)."""
    if len(optimizer.state) > 0:
        raise UsageError("strategy='fsdp' needs an optimizer that has not stepped yet (its params are re-created as shards)")
    new = dict(model.named_parameters())
    for g in optimizer.param_groups:
        try:
            g["params"] = [new[old_to_name[id(q)]] for q in g["params"]]
        except KeyError as exc:
            stray = next(q for q in g["params"] if id(q) not in old_to_name)
            raise UsageError(f"the optimizer holds a parameter that is not in the model (shape {tuple(stray.shape)}); "
                             "build it from model.parameters()") from exc
    return optimizer


def check_unwrapped(model: nn.Module, kind: str) -> None:
    """Raise a :class:`UsageError` unless ``model`` is one ``strategy=kind`` can wrap: not already under DDP or
    ``fully_shard`` (wrapped twice, DDP all-reduced every gradient twice and prefixed every key ``module.module.``;
    FSDP2 failed inside torch with "Invariant encountered: value was None"), and without parameters on the meta
    device (DDP failed on ``Tensor.item()``; FSDP2 kept meta shards that hold no values). Nothing to check for 'none'.

    Example:
        >>> check_unwrapped(nn.Linear(2, 2), "fsdp")   # a plain module on the CPU: fine
    """
    if kind == "none":
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise UsageError(f"strategy={kind!r} was given a model already wrapped in DistributedDataParallel; pass the "
                         "module inside it (ddp_model.module): overdrive wraps it itself")
    sharded = [n or "(the root)" for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise UsageError(f"strategy={kind!r} was given a model already sharded with fully_shard ({', '.join(sharded[:5])}); "
                         "pass the model before fully_shard (overdrive shards each block and the root, with the amp "
                         "policy's MixedPrecisionPolicy; Strategy(kind='fsdp', fsdp_blocks=(...)) picks the blocks)")
    meta = [n for n, q in model.named_parameters() if q.is_meta]
    if meta:
        raise UsageError(f"strategy={kind!r}: {len(meta)} parameter(s) are on the meta device ({', '.join(meta[:3])}), "
                         "which holds no values; materialize the model first, e.g. model.to_empty(device=env.device) "
                         "then re-initialize it (reset_parameters() or a loaded state_dict), and build the optimizer "
                         "on it after that")


class Parallel:
    """One model under one :class:`Strategy`. The training loop calls, in order:
    ``before_amp`` -> amp ``prepare`` -> ``after_amp``; per micro-batch ``accumulation(sync)``;
    after the last micro-batch's backward ``finish_accumulation(mp)``.

    Example:
        >>> # par = Parallel("ddp", device); model, opt, policy = par.before_amp(model, opt, policy)
    """

    def __init__(self, strategy: Strategy | str, device: torch.device, accumulate: int = 1) -> None:
        self.strategy = Strategy.from_name(strategy)
        self.device = torch.device(device)
        self.accumulate = accumulate
        self.wrapped: nn.Module | None = None
        self.model: nn.Module | None = None
        self._fp8_row_hooks: list[Any] = []  # handles of the fp8 token-count checks installed here (FSDP2, O2/O3)
        self.fp8_layers: list[Any] = []  # FSDP2 + fp8: amp.fp8.LayerChoice of every Linear layer (else amp lists them)
        if self.strategy.kind != "none" and not dist.is_initialized():
            raise UsageError(
                f"strategy={self.strategy.kind!r} needs a process group: call overdrive.distributed.init() first "
                "(and start the script with `overdrive launch`)"
            )

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def before_amp(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: Policy | str) -> tuple[nn.Module, torch.optim.Optimizer, Policy]:
        policy = Policy.from_opt_level(policy) if isinstance(policy, str) else policy
        check_unwrapped(model, self.strategy.kind)
        self.model = model
        if self.strategy.kind != "fsdp":
            return model, optimizer, policy
        from torch.distributed.fsdp import fully_shard

        mpp, rest = fsdp_mixed_precision(policy, self.device)
        names = {id(q): n for n, q in model.named_parameters()}  # before fp8 all-gather re-wraps the weights
        fp8_rule = policy.resolve(self.device).fp8  # refused here on a device without fp8, unless emulated
        if fp8_rule is not None:
            # fp8 layers go in before sharding (torchao's order); tensorwise weights are all-gathered in fp8
            from overdrive.amp import fp8 as fp8_mod

            self.fp8_layers = fp8_mod.convert(model, fp8_rule, fsdp_all_gather=fp8_rule.recipe == "tensorwise")
            if rest.fp8 is None:  # O2/O3: amp runs at O0 and never sees the fp8 layers, so their check goes here
                self._fp8_row_hooks = fp8_mod.check_rows(fp8_mod.fp8_modules(model))
        s = self.strategy
        if mpp.param_dtype is not None:
            # BatchNorm keeps fp32 weights (as amp's keep_batchnorm_fp32): its running stats are fp32
            # buffers, and half weights with fp32 stats fail; shard each norm on its own, uncast.
            from torch.distributed.fsdp import MixedPrecisionPolicy

            keep = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    fully_shard(m, mp_policy=keep, reshard_after_forward=s.reshard_after_forward)
        from torch.distributed.fsdp import FSDPModule

        for block in fsdp_blocks(model, s.fsdp_blocks):
            # a BatchNorm that is itself a block (a child of nn.Sequential, or of the root) is sharded above already;
            # sharding it twice failed inside torch ("can only be applied to a module once")
            if not isinstance(block, FSDPModule):
                fully_shard(block, mp_policy=mpp, reshard_after_forward=s.reshard_after_forward)
        fully_shard(model, mp_policy=mpp, reshard_after_forward=s.reshard_after_forward)
        return model, _rebind_optimizer(optimizer, names, model), rest

    def after_amp(self, model: nn.Module, policy: Policy) -> nn.Module:
        """The module the forward runs through (DDP wraps here, after amp cast the weights)."""
        s = self.strategy
        if s.kind == "ddp":
            if self.accumulate > 1 and policy.resolve(self.device).dynamic:
                raise UsageError(
                    "strategy='ddp' with accumulate > 1 and a dynamic fp16 loss scale is not supported (ranks could "
                    "disagree on skipping a step); use bf16, a static loss scale, or accumulate=1"
                )
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            # broadcast_buffers only when changed: torch 2.13 deprecates the name, 2.11 lacks the new one.
            extra = {} if s.broadcast_buffers else {"broadcast_buffers": False}
            # With accumulation every micro-batch runs in no_sync and finish_accumulation reduces the gradients, so
            # DDP's reducer (what static_graph tunes) never runs; a static graph whose first backward is in no_sync
            # fails inside torch ("expect_autograd_hooks_ INTERNAL ASSERT FAILED"), so it is left off there.
            self.wrapped = DDP(
                model, device_ids=ids, bucket_cap_mb=s.bucket_cap_mb, gradient_as_bucket_view=s.gradient_as_bucket_view,
                static_graph=s.static_graph and self.accumulate == 1, find_unused_parameters=s.find_unused_parameters,
                **extra,
            )
            return self.wrapped
        self.wrapped = model
        return model

    @contextlib.contextmanager
    def accumulation(self, sync: bool) -> Iterator[None]:
        """Wrap one micro-batch's forward + backward; ``sync`` is True on the last one."""
        kind = self.strategy.kind
        if kind == "ddp" and (self.accumulate > 1 or not sync):
            assert self.wrapped is not None
            with self.wrapped.no_sync():  # type: ignore[operator]
                yield
            if sync:
                # A forward under no_sync tells DDP not to broadcast the buffers at the next forward; a hand-written
                # loop runs its last micro-batch outside no_sync, which tells it to. Every micro-batch here runs in
                # no_sync, so BatchNorm's running stats were never broadcast after the first step and drifted apart
                # over ranks. The step's end is marked as DDP marks it: rank 0's buffers go out at the next forward.
                self.wrapped.require_forward_param_sync = True  # type: ignore[union-attr]
            return
        if kind == "fsdp" and self.accumulate > 1:
            self.wrapped.set_requires_gradient_sync(sync)  # type: ignore[union-attr]
        yield

    def check_same_batches(self, batches: int | None, epoch: int, what: str = "training") -> None:
        """Raise on every rank unless every rank's training data has the same number of batches this epoch (one
        small all-reduce; skipped where a rank's data has no ``len``). DDP and FSDP2 run one collective per step, so
        a rank with a batch more waited in it forever while the others had finished (or went on to their own
        collectives in a save). ``what="evaluation"`` checks the evaluation data, which only FSDP2 needs even (each
        forward all-gathers the weights; DDP evaluates the unwrapped module, without collectives).

        Example:
            >>> # par.check_same_batches(len(loader), epoch=0)   # at the start of each epoch, on every rank
        """
        if self.strategy.kind == "none" or self.world_size == 1:
            return
        if what == "evaluation" and self.strategy.kind != "fsdp":
            return
        n = -1 if batches is None else int(batches)
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        both = torch.tensor([n, -n], dtype=torch.int64, device=dev)  # max and -min in one all-reduce
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        most, fewest = int(both[0]), -int(both[1])
        if fewest < 0 or most == fewest:  # a rank without len (its count is unknown), or all equal
            return
        if what == "evaluation":
            raise UsageError(
                f"epoch {epoch}: this rank ({dist.get_rank()}) has {n} evaluation batches, but the ranks have between "
                f"{fewest} and {most}; strategy='fsdp' all-gathers the weights in every forward, so each rank needs "
                "the same batch count (the rank with more would wait in an all-gather forever): give every rank the "
                "same number of evaluation batches (their sizes may differ), e.g. with torch's DistributedSampler, "
                "which evens the shards by repeating up to world_size - 1 samples"
            )
        raise UsageError(
            f"epoch {epoch}: this rank ({dist.get_rank()}) has {n} training batches, but the ranks have between "
            f"{fewest} and {most}; strategy={self.strategy.kind!r} needs the same count on every rank (the rank with "
            "more would wait in a collective forever): shard with torch's DistributedSampler (pads) or "
            "overdrive.distributed.ResumableSampler (drops the tail)"
        )

    def after_step(self) -> None:
        """After each optimizer step: under FSDP2 with fp8 all-gather, the next forward's fp8 weight scales in one
        all-reduce (:func:`overdrive.amp.fp8.precompute_fsdp_scales`); nothing otherwise."""
        if self.fp8_layers and self.strategy.kind == "fsdp" and self.model is not None:
            from overdrive.amp import fp8 as fp8_mod

            fp8_mod.precompute_fsdp_scales(self.model)

    def finish_accumulation(self, params: Iterator[nn.Parameter]) -> None:
        """DDP with accumulation: average the accumulated optimizer gradients over ranks, bucketed."""
        if self.strategy.kind != "ddp" or self.accumulate == 1:
            return
        ps = list(params)
        if dist.get_world_size() > 1 and ps:
            # the same list on every rank, or the buckets pair one rank's gradient of a layer with another's of a
            # different one (a head some ranks did not use: silently mixed where the shapes matched). A parameter
            # some rank used gets a zero gradient where it has none, as DDP's find_unused_parameters gives it; one
            # no rank used keeps None (the optimizer leaves it as DDP would)
            dev = next((q.grad.device for q in ps if q.grad is not None), ps[0].device)
            used = torch.tensor([q.grad is not None for q in ps], dtype=torch.float32, device=dev)
            dist.all_reduce(used)
            for q, u in zip(ps, used.tolist()):
                if u > 0 and q.grad is None:
                    q.grad = torch.zeros_like(q)
        all_reduce_mean([q.grad for q in ps if q.grad is not None], self.strategy.bucket_cap_mb)


def all_reduce_mean(tensors: list[torch.Tensor], bucket_cap_mb: float = 25.0) -> None:
    """Average ``tensors`` in place over all ranks: flattened into buckets of ``bucket_cap_mb`` per dtype.

    SUM then divide (not ReduceOp.AVG, which gloo lacks).
    """
    world = dist.get_world_size()
    if world == 1 or not tensors:
        return
    cap = int(bucket_cap_mb * 2**20)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group + [None]:  # type: ignore[list-item]
            if t is not None and (size + t.numel() * t.element_size() <= cap or not bucket):
                bucket.append(t)
                size += t.numel() * t.element_size()
                continue
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat)
            flat.div_(world)
            torch._foreach_copy_(bucket, [v.view_as(b) for v, b in zip(flat.split([b.numel() for b in bucket]), bucket)])
            bucket, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)
