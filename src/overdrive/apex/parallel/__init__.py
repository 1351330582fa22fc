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
hook. :class:`Reducer` averages gradients only when asked (``reducer.reduce()``). ``gradient_average=False`` (a sum) changes the numbers and is refused with what to do instead;
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

# the devices torch's own SyncBatchNorm synchronizes on; on the others (CPU ranks of a gloo group) it raised
_TORCH_SYNC_DEVICES = ("cuda", "hpu", "xpu")


class SyncBatchNorm(nn.SyncBatchNorm):
    """apex.parallel.SyncBatchNorm: torch's SyncBatchNorm (a subclass) with apex's ``channel_last`` (the input's
    last dimension holds the channels, ``(N, ..., C)``), ``fuse_relu`` and the residual ``z`` of
    ``forward(input, z)``: ``relu(bn(input) + z)``. Without a process group (one process, CPU or GPU) it
    normalizes by the local batch, as a BatchNorm. On GPUs torch's kernels synchronize the statistics; on CPU
    ranks (a gloo group, where torch's SyncBatchNorm refuses to run) the batch's sums are all-reduced here, with
    gradients, so the layer normalizes by the global batch there too, and this package's
    :class:`DistributedDataParallel` takes it on a CPU module.

    Example:
        >>> bn = SyncBatchNorm(3, channel_last=True, fuse_relu=True)
        >>> bn(torch.randn(4, 5, 3)).shape, bool((bn(torch.randn(4, 5, 3)) >= 0).all())
        (torch.Size([4, 5, 3]), True)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, process_group=process_group)
        self.channel_last = bool(channel_last)
        self.fuse_relu = bool(fuse_relu)

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002 - apex's
        """``bn(input)`` (channels at dim 1, or last with ``channel_last``), plus ``z``, then relu if fused."""
        moved = self.channel_last and input.dim() > 2
        x = input.movedim(-1, 1) if moved else input
        out = self._cpu_sync_forward(x) if self._syncs_here(x) else super().forward(x)
        if moved:
            out = out.movedim(1, -1)  # (N, C, ...) -> (N, ..., C)
        if z is not None:
            if z.shape != out.shape:
                raise UsageError(f"SyncBatchNorm(z=...) has shape {tuple(z.shape)}, the output {tuple(out.shape)}; "
                                 "pass a residual of the input's shape")
            out = out + z
        return torch.relu(out) if self.fuse_relu else out

    def _syncs_here(self, x: torch.Tensor) -> bool:
        """Whether this forward synchronizes statistics that torch's kernels cannot: a training forward on a
        device torch's SyncBatchNorm refuses, under an initialized process group."""
        import torch.distributed as dist

        return (self.training and x.device.type not in _TORCH_SYNC_DEVICES and dist.is_available()
                and dist.is_initialized())

    def _cpu_sync_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Batch norm of ``x`` ``(N, C, ...)`` by the statistics of every rank's batch: the per-channel mean, then
        the sum of squared deviations from it, each all-reduced (autograd-aware: the backward all-reduces their
        gradients, as torch's sync_batch_norm does), in fp32 whatever ``x``'s dtype."""
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_reduce

        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        group = self.process_group or dist.group.WORLD
        if dist.get_world_size(group) == 1:  # the local batch is the global one
            return nn.functional.batch_norm(
                x, self.running_mean if self.track_running_stats else None,
                self.running_var if self.track_running_stats else None,
                self.weight, self.bias, True, factor, self.eps)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)  # (1, C, 1, ...)
        xf = x.float()
        local = torch.tensor([x.numel() // max(x.shape[1], 1)], dtype=torch.float32, device=x.device)
        sums = all_reduce(torch.cat([xf.sum(dims), local]), group=group)
        count = sums[-1]
        mean = sums[:-1] / count  # (C,)
        centered = xf - mean.reshape(shape)
        var = all_reduce(centered.square().sum(dims), group=group) / count  # biased, as the normalization uses
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            out = out * self.weight.float().reshape(shape) + self.bias.float().reshape(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var.detach() * count / (count - 1).clamp(min=1)
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(x.dtype)


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """apex.parallel.convert_syncbn_model: every BatchNorm layer of ``module`` replaced by :class:`SyncBatchNorm`
    sharing its parameters and statistics (an optimizer built before still steps them); returns the new module.

    Example:
        >>> net = convert_syncbn_model(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
        >>> type(net[1]).__name__, isinstance(net[1], nn.SyncBatchNorm)
        ('SyncBatchNorm', True)
    """
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last=channel_last)
        if isinstance(module, SyncBatchNorm):
            out.fuse_relu = module.fuse_relu
        with torch.no_grad():
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(out, name, getattr(module, name))
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return out


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

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """torch's DDP refuses a CPU module holding SyncBatchNorm layers, since torch's cannot synchronize on CPU;
        this package's :class:`SyncBatchNorm` can (a gloo group), so only other SyncBatchNorm layers are refused."""
        if self.device_type != "cpu" or any(isinstance(m, nn.SyncBatchNorm) and not isinstance(m, SyncBatchNorm)
                                            for m in module.modules()):
            super()._passing_sync_batchnorm_handle(module)

    def disable_allreduce(self) -> None:
        """apex's: backward passes accumulate gradients locally until :meth:`enable_allreduce`."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """apex's: the next backward all-reduces (the accumulated gradients) again."""
        self.require_backward_grad_sync = True


class Reducer:
    """apex.parallel.Reducer: gradients averaged over the ranks only when :meth:`reduce` is called (every few
    iterations, say), not during backward as DDP does.

    Given a module, its parameters are broadcast from rank 0 at construction (every rank starts from the same
    weights) and :meth:`reduce` averages the gradients its parameters hold at that moment. Given tensors (an
    iterable, nested lists / tuples / dicts as apex took), :meth:`reduce` averages those very tensors in place:
    they must still be the ``.grad`` tensors at that point (``optimizer.zero_grad(set_to_none=False)``), and their
    parameters' sync at the start is the caller's, as in apex. The average is a flattened all-reduce per dtype (a
    sum divided by the world size). Every rank must call :meth:`reduce`, with the same tensors.

    Example:
        >>> # reducer = Reducer(model)         # after init_process_group; weights now rank 0's
        >>> # loss.backward(); reducer.reduce(); optimizer.step()
    """

    def __init__(self, module_or_grads_list: nn.Module | Any) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("Reducer(...) needs a process group: call overdrive.distributed.init() (or "
                             "torch.distributed.init_process_group) before building it")
        if isinstance(module_or_grads_list, nn.Module):
            self.module: nn.Module | None = module_or_grads_list
            self.grads: list[torch.Tensor] = []
            with torch.no_grad():
                for q in self.module.parameters():  # one broadcast per tensor: exact for every dtype
                    dist.broadcast(q.data, src=0)
        else:
            self.module = None
            self.grads = _tensors(module_or_grads_list)

    def reduce(self) -> None:
        """Average the gradients over every rank, in place (a collective: every rank calls it)."""
        from overdrive.distributed import all_reduce_mean

        if self.module is not None:
            grads = [q.grad for q in self.module.parameters() if q.grad is not None]
        else:
            grads = self.grads
        all_reduce_mean([g.data for g in grads])


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` (a tensor, or lists / tuples / dicts of them), in order; anything else is refused."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)) or (hasattr(obj, "__iter__") and not isinstance(obj, (str, bytes))):
        return [t for item in obj for t in _tensors(item)]
    raise UsageError(f"Reducer(...) was given a {type(obj).__name__}; pass a module or an iterable of gradient "
                     "tensors (e.g. [p.grad for p in model.parameters()])")


ReduceOp = _ReduceOp


__all__ = ["DistributedDataParallel", "LARC", "ReduceOp", "Reducer", "SyncBatchNorm", "convert_syncbn_model"]
