"""apex.parallel: ``DistributedDataParallel`` as torch's, with apex's keyword arguments, SyncBatchNorm, and
:class:`~overdrive.apex.parallel.LARC.LARC` (``from apex.parallel import LARC`` and ``from apex.parallel.LARC
import LARC`` both port).

apex's DDP averaged gradients with bucketed all-reduces overlapped with backward, as torch's does. Its
keywords map as follows: ``message_size`` (elements per bucket) becomes ``bucket_cap_mb`` (at 4 bytes per
element); ``delay_allreduce=True`` (one all-reduce after backward) is accepted: torch overlaps the
all-reduce with backward instead, and the averaged gradients are the same; ``gradient_predivide_factor``
is accepted (apex divided before and after the all-reduce; the average is the same); ``num_allreduce_streams``,
``allreduce_communicators``, ``retain_allreduce_buffers`` and ``prof`` tune only how apex ran the
all-reduce and are accepted. ``allreduce_always_fp32=True`` averages half gradients in fp32 through a comm
hook. ``gradient_average=False`` (a sum) changes the numbers and is refused with what to do instead;
``shared_param`` / ``allreduce_trigger_params`` are refused (torch finds the parameters that get gradients:
pass ``find_unused_parameters=True``). ``DistributedDataParallel`` is a subclass of torch's, so isinstance
checks with either name hold.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.apex.parallel.LARC import LARC

try:  # apex.parallel re-exported torch.distributed's ReduceOp
    from torch.distributed import ReduceOp as _ReduceOp
except ImportError:  # a torch built without distributed
    _ReduceOp = None

SyncBatchNorm = nn.SyncBatchNorm


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """apex.parallel.convert_syncbn_model: ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``."""
    if channel_last:
        raise UsageError("convert_syncbn_model(channel_last=True) is apex's NHWC kernel; torch's SyncBatchNorm takes "
                         "any memory format: leave channel_last unset")
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)


def _fp32_allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN202 - DDP refuses hooks whose annotations
    # are not its own classes, and this module's annotations are strings
    """A DDP comm hook that averages a bucket's gradients in fp32 whatever their dtype (apex's
    ``allreduce_always_fp32``): cast up, divide by the world size, all-reduce, cast back into the bucket."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    wide = buf.to(torch.float32).div_(dist.get_world_size(group))
    fut = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def back(f: Any) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex.parallel.DistributedDataParallel: torch's DDP (a subclass: ``isinstance(model, DDP)`` holds for either
    name) called with apex's arguments (see the module docstring), plus apex's ``disable_allreduce()`` /
    ``enable_allreduce()`` (gradient accumulation without communication: torch's ``no_sync`` as two calls).

    ``device_ids`` defaults to the current CUDA device for a CUDA module (apex used it implicitly);
    other torch DDP keywords pass through. ``allreduce_always_fp32=True`` registers a comm hook that averages
    fp16/bf16 gradient buckets in fp32 (with fp32 parameters it changes nothing).

    Example:
        >>> # model = DistributedDataParallel(model.cuda(), delay_allreduce=True)
        >>> # model.disable_allreduce(); loss.backward(); model.enable_allreduce()
    """

    def __init__(
        self,
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
    ) -> None:
        if not gradient_average:
            raise UsageError("gradient_average=False (summed gradients) is not torch DDP's behaviour; keep the "
                             "average and multiply the learning rate (or the loss) by the world size")
        if shared_param is not None or allreduce_trigger_params is not None:
            raise UsageError("shared_param / allreduce_trigger_params are not needed: torch DDP finds the parameters "
                             "that get gradients; pass find_unused_parameters=True if some do not")
        if not message_size or message_size <= 0:
            raise UsageError(f"message_size={message_size!r} must be a positive number of elements")
        torch_kwargs.setdefault("bucket_cap_mb", message_size * 4 / 2**20)
        first = next(module.parameters(), None)
        if first is not None and first.is_cuda and "device_ids" not in torch_kwargs:
            torch_kwargs["device_ids"] = [torch.cuda.current_device()]
        super().__init__(module, **torch_kwargs)
        if allreduce_always_fp32 and any(q.is_floating_point() and q.dtype != torch.float32
                                         for q in module.parameters()):
            self.register_comm_hook(torch_kwargs.get("process_group"), _fp32_allreduce_hook)

    def disable_allreduce(self) -> None:
        """apex's: backward passes accumulate gradients locally until :meth:`enable_allreduce`."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """apex's: the next backward all-reduces (the accumulated gradients) again."""
        self.require_backward_grad_sync = True


ReduceOp = _ReduceOp


__all__ = ["DistributedDataParallel", "LARC", "ReduceOp", "SyncBatchNorm", "convert_syncbn_model"]
