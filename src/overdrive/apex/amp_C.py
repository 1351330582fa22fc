"""apex's ``amp_C`` CUDA extension, the ops scripts call through ``multi_tensor_applier``, as torch ``_foreach`` ops.

Each op takes apex's arguments, ``(chunk_size, noop_flag, tensor_lists, *args)``, computes in fp32 as apex's kernels
do, and sets ``noop_flag`` (apex's overflow buffer, a one-element int tensor) to 1 when an input it checks holds
inf or NaN, without reading it back (no host sync). ``chunk_size`` only tiled apex's kernels and is ignored. Any
device and any float dtype work (apex: CUDA only).

| op | computes | checks |
|----|----------|--------|
| ``multi_tensor_scale(c, noop, [ins, outs], scale)`` | ``out = in * scale`` (cast to out's dtype) | the inputs |
| ``multi_tensor_axpby(c, noop, [xs, ys, outs], a, b, arg_to_check)`` | ``out = a*x + b*y`` | x (0), y (1) or both (-1) |
| ``multi_tensor_l2norm(c, noop, [ts], per_tensor=False)`` | ``(norm (1,), per-tensor norms (n,) or (0,))`` in fp32 | the norm |

``multi_tensor_l2norm_mp`` is ``multi_tensor_l2norm`` (apex's variant for mixed-precision inputs; fp32 here always).
Other ops of apex's ``amp_C`` (``multi_tensor_adam``, ``multi_tensor_lamb``, ``multi_tensor_sgd``, ...) are the inner
loops of apex's fused optimizers: use the optimizers (``overdrive.apex.optimizers`` or ``torch.optim``) instead.

Example:
    >>> import torch
    >>> noop = torch.zeros(1, dtype=torch.int)
    >>> grads, out = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])], [torch.empty(2), torch.empty(1)]
    >>> multi_tensor_scale(2048 * 32, noop, [grads, out], 0.5)
    >>> out[0].tolist(), noop.item()
    ([1.0, 2.0], 1)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from overdrive._utils.errors import UsageError

TensorLists = Sequence[Sequence[torch.Tensor]]


def _lists(name: str, tensor_lists: TensorLists, n: int) -> list[list[torch.Tensor]]:
    if len(tensor_lists) != n or len({len(t) for t in tensor_lists}) > 1:
        raise UsageError(f"{name} takes {n} tensor lists of one length; got {len(tensor_lists)} list(s) of lengths "
                         f"{[len(t) for t in tensor_lists]}")
    return [list(t) for t in tensor_lists]


def _flag_nonfinite(noop_flag: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Set ``noop_flag`` to 1 when any of ``tensors`` holds inf or NaN; leave it as it is otherwise (as apex's
    kernels, which only ever write 1). The inf-norm of a tensor is inf or NaN exactly when an element is."""
    if not tensors:
        return
    norms = torch.stack([n.float() for n in torch._foreach_norm(list(tensors), float("inf"))])
    noop_flag.masked_fill_((~torch.isfinite(norms)).any().to(noop_flag.device), 1)


def _fp32(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """``out = in * scale`` for each pair of ``tensor_lists = [ins, outs]`` (fp32 math, out's dtype); flags a
    non-finite input in ``noop_flag``. ``ins`` and ``outs`` may be the same tensors (in place).

    Example:
        >>> noop = torch.zeros(1, dtype=torch.int); g = [torch.ones(3)]
        >>> multi_tensor_scale(2048, noop, [g, g], 0.25); g[0].tolist(), noop.item()
        ([0.25, 0.25, 0.25], 0)
    """
    ins, outs = _lists("multi_tensor_scale", tensor_lists, 2)
    if not ins:
        return
    _flag_nonfinite(noop_flag, ins)
    torch._foreach_copy_(outs, torch._foreach_mul(_fp32(ins), float(scale)))


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, a: float, b: float,
                       arg_to_check: int) -> None:
    """``out = a*x + b*y`` for ``tensor_lists = [xs, ys, outs]`` (fp32 math); ``arg_to_check`` says which inputs
    set ``noop_flag`` when non-finite: 0 the xs, 1 the ys, -1 both (apex's convention).

    Example:
        >>> noop = torch.zeros(1, dtype=torch.int); out = [torch.empty(2)]
        >>> multi_tensor_axpby(2048, noop, [[torch.ones(2)], [torch.full((2,), 3.0)], out], 2.0, 0.5, -1)
        >>> out[0].tolist()
        [3.5, 3.5]
    """
    xs, ys, outs = _lists("multi_tensor_axpby", tensor_lists, 3)
    if arg_to_check not in (-1, 0, 1):
        raise UsageError(f"multi_tensor_axpby(arg_to_check={arg_to_check!r}): expected -1 (x and y), 0 (x) or 1 (y)")
    if not xs:
        return
    _flag_nonfinite(noop_flag, (xs + ys) if arg_to_check == -1 else (xs if arg_to_check == 0 else ys))
    out = torch._foreach_mul(_fp32(xs), float(a))
    torch._foreach_add_(out, _fp32(ys), alpha=float(b))
    torch._foreach_copy_(outs, out)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                        per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all of ``tensor_lists[0]`` together, as a (1,) fp32 tensor, and each tensor's norm ((n,), or
    an empty (0,) tensor unless ``per_tensor``); squares summed in fp32 as apex does. A non-finite norm sets
    ``noop_flag``.

    Example:
        >>> noop = torch.zeros(1, dtype=torch.int)
        >>> total, each = multi_tensor_l2norm(2048, noop, [[torch.full((4,), 1.5), torch.tensor([4.0])]], True)
        >>> total.tolist(), each.tolist()
        ([5.0], [3.0, 4.0])
    """
    if len(tensor_lists) != 1:
        raise UsageError(f"multi_tensor_l2norm takes one tensor list; got {len(tensor_lists)}")
    tensors = list(tensor_lists[0])
    if not tensors:
        raise UsageError("multi_tensor_l2norm got an empty tensor list (apex's kernel needs one tensor at least)")
    each = torch.stack([n.to(tensors[0].device) for n in torch._foreach_norm(tensors, 2.0, dtype=torch.float32)])
    total = torch.linalg.vector_norm(each).reshape(1)
    noop_flag.masked_fill_((~torch.isfinite(total)).any().to(noop_flag.device), 1)
    return total, each if per_tensor else each.new_empty(0)


multi_tensor_l2norm_mp = multi_tensor_l2norm

_OPTIMIZER_OPS = {
    "multi_tensor_adam": "FusedAdam", "multi_tensor_adagrad": "FusedAdagrad", "multi_tensor_sgd": "FusedSGD",
    "multi_tensor_lamb": "FusedLAMB", "multi_tensor_lamb_mp": "FusedMixedPrecisionLamb",
    "multi_tensor_lamb_stage1_cuda": "FusedLAMB", "multi_tensor_lamb_stage2_cuda": "FusedLAMB",
    "multi_tensor_novograd": "FusedNovoGrad",
}


def __getattr__(name: str) -> object:
    if name in _OPTIMIZER_OPS:
        raise AttributeError(
            f"amp_C.{name} is the inner loop of apex's {_OPTIMIZER_OPS[name]} and is not provided: build the optimizer "
            f"(from overdrive.apex.optimizers import {_OPTIMIZER_OPS[name]}) and call its step() instead")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (provided: {', '.join(__all__)})")


__all__ = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp"]
