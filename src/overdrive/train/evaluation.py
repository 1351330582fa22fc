"""Evaluation outside the training step: mean loss and top-1 accuracy over a dataset, and the training state's memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive._utils.trees import map_tensors
from overdrive.amp import MixedPrecision
from overdrive.train.batches import (
    Batch, _call, _float_output, _movable, _own_loss, _rows, _scores, _send, _split, _uses_own_loss,
)

if TYPE_CHECKING:
    from overdrive.train.loop import Trainer


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Iterable[Batch],
    mp: MixedPrecision | None = None,
    channels_last: bool = False,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    *,
    over_ranks: bool = False,
) -> tuple[float, float | None]:
    """Mean loss and top-1 accuracy of ``model`` over ``data`` (under ``mp``'s autocast if given). The accuracy is
    None unless every batch is (N, C) class scores (a tensor, or the ``logits`` of a Hugging Face ModelOutput)
    against (N,) integer targets (binary logits, per-token outputs and regression have no top-1 accuracy).

    ``loss_fn(output, target)`` is called as in training and must return the batch *mean* (the
    convention of torch's losses); each batch is weighted by its size, so the result is the mean
    over samples. Without it, the loss is cross-entropy; for a dict batch with ``"labels"`` (a Hugging Face
    DataCollator's), the model's own ``output.loss``, weighted by the batch's size as the HF Trainer's ``eval_loss``
    (for a language model, each batch's mean over its tokens: a batch of few tokens weighs as much as one of many).

    ``over_ranks=True`` (what :meth:`Trainer.fit` passes under ``strategy="ddp"|"fsdp"``): each rank evaluates its
    own shard of the data and the loss sums, correct counts and sample counts are summed over the default process
    group (one all-reduce; every rank must call), so every rank returns the mean over all the ranks' samples, as
    one process evaluating their union would, also when the shards differ in size. A rank may hold no sample.
    Where ``data`` is a DataLoader over torch's ``DistributedSampler`` (``drop_last=False``), the samples it repeats
    to even the shards (up to ``world_size - 1``, the last of the padded order) are left out, so the mean is over
    the dataset's ``len`` samples, each counted once (as torchmetrics' and accelerate's ``gather_for_metrics``).

    Example:
        >>> evaluate(nn.Linear(4, 3), [(torch.randn(8, 4), torch.randint(0, 3, (8,)))])[1] <= 1.0
        True
    """
    was_training = model.training
    model.eval()
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    total_loss = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    n = 0
    classifies = True  # every batch so far is (N, C) scores against (N,) class indices
    region = mp.autocast if mp is not None else contextlib.nullcontext
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return _send(t, device, non_blocking=False) if _movable(t) else t  # a graph batch's own to(device)
        t = t.to(device)
        return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t

    real = _unpadded_samples(data) if over_ranks else None  # this rank's samples before DistributedSampler's padding
    seen = 0
    for batch in data:
        own = _uses_own_loss(batch, loss_fn is not None)
        x, y = _split(batch, loss_fn is not None)
        x, y = map_tensors(move, x), map_tensors(move, y)  # a user's @dataclass inputs too
        with region():
            out = _call(model, x)
        out = _float_output(out, loss_fn is not None or own)
        rows = _rows(x, y)
        if real is not None:
            keep = max(0, min(rows, real - seen))
            seen += rows
            if keep < rows:  # the padding is the tail of this rank's order: drop the repeated rows, (rows, ...) -> (keep, ...)
                out, y = map_tensors(lambda t: _head(t, rows, keep), out), map_tensors(lambda t: _head(t, rows, keep), y)
                rows = keep
                if rows == 0:
                    continue
        if own:  # the model's batch mean (over its tokens, for a language model), weighted by the batch's size
            total_loss += _own_loss(out).double() * rows
        elif loss_fn is None:
            total_loss += nn.functional.cross_entropy(out, y, reduction="sum").double()
        else:
            # a user loss has no ``reduction`` argument: undo its batch mean. Under the autocast the training step
            # computes it in (fp32 for cross-entropy and MSE): outside it, a structured output's half-precision
            # logits gave a loss rounded to bf16 (2**-9 relative), unlike the training loss of the same weights
            with region():
                total_loss += loss_fn(out, y).double() * rows
        scores = _scores(out)  # a Hugging Face ModelOutput's logits
        if classifies and isinstance(scores, torch.Tensor) and isinstance(y, torch.Tensor) \
                and _is_classification(scores, y):
            correct += (scores.argmax(dim=-1) == y).sum()
        else:  # one logit per sample (BCE), per-token outputs, regression: top-1 accuracy is not defined here
            classifies = False
        n += rows
    model.train(was_training)
    if over_ranks:
        total, right, n, classifies = _sum_over_ranks(total_loss, correct, n, classifies)
    else:
        total, right = float(total_loss), float(correct)
    if n == 0:
        raise UsageError("the evaluation data yielded no sample" + (" on any rank" if over_ranks else ""))
    return total / n, right / n if classifies else None


def _unpadded_samples(data: Any) -> int | None:
    """How many of this rank's samples are the dataset's own when ``data`` is a DataLoader over torch's
    ``DistributedSampler`` with ``drop_last=False`` that pads (None otherwise). The sampler deals the padded order
    round-robin, rank ``r`` taking positions ``r, r + W, ...``; positions from ``len(dataset)`` on repeat the
    order's first samples, so they are the last ones each rank sees.

    Example:
        >>> from torch.utils.data import DataLoader, DistributedSampler
        >>> ds = list(range(9))
        >>> [_unpadded_samples(DataLoader(ds, sampler=DistributedSampler(ds, 2, r))) for r in (0, 1)]
        [5, 4]
    """
    from torch.utils.data import DistributedSampler

    sampler = getattr(data, "sampler", None)
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(getattr(data, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    try:
        n = len(sampler.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if sampler.total_size == n:  # nothing padded
        return None
    return max(0, -(-(n - sampler.rank) // sampler.num_replicas))  # positions rank, rank + W, ... below n


def _head(t: Any, rows: int, keep: int) -> Any:
    """The first ``keep`` of ``rows`` samples of ``t`` (batch dimension first); anything else unchanged."""
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows:
        return t[:keep]
    return t


def _sum_over_ranks(
    total_loss: torch.Tensor, correct: torch.Tensor, n: int, classifies: bool
) -> tuple[float, float, int, bool]:
    """The evaluation sums of every rank of the default process group, summed (itself without one): a mean of the
    ranks' means weighted each rank alike, and a rank with a short last batch moved the result off the mean over
    samples. Accuracy stays defined only where every rank's batches classify."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(total_loss), float(correct), n, classifies
    # (4,) float64: integers below 2**53 stay exact; a rank without samples has classifies True (nothing against it)
    dev = total_loss.device
    t = torch.stack([total_loss.double(), correct.double(), torch.tensor(float(n), dtype=torch.float64, device=dev),
                     torch.tensor(0.0 if classifies else 1.0, dtype=torch.float64, device=dev)])
    dist.all_reduce(t)
    total, right, count, not_classifying = t.tolist()
    return total, right, int(count), not_classifying == 0


def _is_classification(out: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``out`` (N, C) scores C > 1 classes for integer targets ``y`` (N,): where top-1 accuracy means what it
    says. A (N, 1) logit against (N, 1) targets broadcast to (N, N) and read 500%.

    Example:
        >>> _is_classification(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
        True
        >>> _is_classification(torch.zeros(4, 1), torch.zeros(4, 1))
        False
    """
    return (out.dim() == 2 and out.shape[1] > 1 and y.dim() == 1 and out.shape[0] == y.shape[0]
            and not y.is_floating_point() and not y.is_complex())


def memory_mib(trainer: Trainer) -> float:
    """Peak memory: CUDA's peak allocated bytes, or on CPU the training state's bytes
    (parameters, gradients, fp32 masters and optimizer state), which torch cannot track as a peak."""
    if trainer.device.type == "cuda":
        return torch.cuda.max_memory_allocated(trainer.device) / 2**20
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for p in trainer.model.parameters():
        add(p)
        add(p.grad)
    for p in trainer.mp.master_params():
        add(p)
        add(p.grad)
    for st in trainer.optimizer.state.values():
        for v in st.values():
            add(v)
    return total / 2**20
