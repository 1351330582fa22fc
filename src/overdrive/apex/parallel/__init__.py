"""apex.parallel: ``DistributedDataParallel`` as torch's, with apex's keyword arguments, SyncBatchNorm, and
:class:`~overdrive.apex.parallel.LARC.LARC` (``from apex.parallel import LARC`` and ``from apex.parallel.LARC
import LARC`` both port).

apex's DDP averaged gradients with bucketed all-reduces overlapped with backward, as torch's does. Its
keywords map as follows: ``message_size`` (elements per bucket) becomes ``bucket_cap_mb`` (at 4 bytes per
element); ``delay_allreduce=True`` (one all-reduce after backward) is accepted: torch overlaps the
all-reduce with backward instead, and the averaged gradients are the same; ``gradient_predivide_factor``
is accepted (apex divided before and after the all-reduce; the average is the same); ``num_allreduce_streams``,
``allreduce_communicators``, ``retain_allreduce_buffers`` and ``prof`` tune only how apex ran the
all-reduce and are accepted. ``gradient_average=False`` (a sum) and ``allreduce_always_fp32=True`` change
the numbers and are refused with what to do instead; ``shared_param`` / ``allreduce_trigger_params`` are
refused (torch finds the parameters that get gradients: pass ``find_unused_parameters=True``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.apex.parallel.LARC import LARC

SyncBatchNorm = nn.SyncBatchNorm


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """apex.parallel.convert_syncbn_model: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``."""
    if channel_last:
        raise UsageError("convert_syncbn_model(channel_last=True) is apex's NHWC kernel; torch's SyncBatchNorm takes "
                         "any memory format: leave channel_last unset")
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)


def DistributedDataParallel(  # noqa: N802 - apex's class name; returns torch's DDP
    module: nn.Module,
    message_size: int = 10_000_000,
    delay_allreduce: bool = False,
    shared_param: Any = None,
    allreduce_trigger_params: Any = None,
    retain_allreduce_buffers: bool = False,
    allreduce_always_fp32: bool = False,
    num_allreduce_streams: int = 1,
    allreduce_communicators: Any = None,
    gradient_average: bool = True,
    gradient_predivide_factor: float = 1.0,
    gradient_average_split_factor: float | None = None,
    prof: bool = False,
    **torch_kwargs: Any,
) -> nn.parallel.DistributedDataParallel:
    """torch.nn.parallel.DistributedDataParallel, called with apex's arguments (see the module docstring).

    ``device_ids`` defaults to the current CUDA device for a CUDA module (apex used it implicitly);
    other torch DDP keywords pass through.
    """
    if not gradient_average:
        raise UsageError("gradient_average=False (summed gradients) is not torch DDP's behaviour; keep the average "
                         "and multiply the learning rate (or the loss) by the world size")
    if allreduce_always_fp32:
        raise UsageError("allreduce_always_fp32=True: torch DDP all-reduces gradients in their own dtype; to reduce "
                         "in fp32, train at O1 (fp32 parameters, so fp32 gradients) or register a DDP comm hook "
                         "(ddp.register_comm_hook) that casts the bucket to fp32")
    if shared_param is not None or allreduce_trigger_params is not None:
        raise UsageError("shared_param / allreduce_trigger_params are not needed: torch DDP finds the parameters "
                         "that get gradients; pass find_unused_parameters=True if some do not")
    if not message_size or message_size <= 0:
        raise UsageError(f"message_size={message_size!r} must be a positive number of elements")
    torch_kwargs.setdefault("bucket_cap_mb", message_size * 4 / 2**20)
    first = next(module.parameters(), None)
    if first is not None and first.is_cuda and "device_ids" not in torch_kwargs:
        torch_kwargs["device_ids"] = [torch.cuda.current_device()]
    return nn.parallel.DistributedDataParallel(module, **torch_kwargs)


__all__ = ["DistributedDataParallel", "LARC", "SyncBatchNorm", "convert_syncbn_model"]
