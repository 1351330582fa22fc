"""Distributed training on torch.distributed: DDP / FSDP2 in the training loop, torchrun launch
with restarts, sharded DCP checkpoints, and an NCCL doctor.

Example:
    >>> # in train.py, started with `overdrive launch --nproc-per-node 8 train.py`:
    >>> # env = overdrive.distributed.init()
    >>> # trainer = Trainer(model.to(env.device), opt, policy="O2", strategy="fsdp")
"""

from overdrive.distributed import checkpoint
from overdrive.distributed.config import DDP, FSDP, PRESETS, LaunchConfig, Strategy
from overdrive.distributed.parallel import DistEnv, Parallel, all_reduce_mean, free_port, fsdp_mixed_precision, init, leave
from overdrive.distributed.sampler import ResumableSampler

__all__ = [
    "Strategy", "LaunchConfig", "DDP", "FSDP", "PRESETS",
    "init", "leave", "DistEnv", "Parallel", "all_reduce_mean", "free_port", "fsdp_mixed_precision",
    "ResumableSampler", "checkpoint",
]
