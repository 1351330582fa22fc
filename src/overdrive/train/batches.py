"""How the Trainer reads a batch: ``(inputs, targets)`` with inputs a tensor, a tuple (``model(*inputs)``) or a dict
(``model(**inputs)``) of them, and how it walks the data of an epoch (``set_epoch``, the last-batch mark).

Example:
    >>> import torch
    >>> _rows((torch.zeros(3, 2), torch.zeros(3)))
    3
    >>> [last for _, last in _mark_last([1, 2, 3])]
    [False, False, True]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_is_leaf

from overdrive._utils.errors import UsageError
from overdrive._utils.trees import map_tensors, tensor_leaves

Batch = tuple[torch.Tensor, torch.Tensor]


LABELS = "labels"  # the key of a Hugging Face batch's targets (a DataCollator's dict), as the HF Trainer's label_names


def _split(batch: Any, loss_fn_given: bool = False) -> tuple[Any, Any]:
    """A batch as (inputs, targets), or a one-line error saying what the Trainer takes.

    A dict with ``"labels"`` (what a Hugging Face DataCollator yields) is a batch too, as the HF Trainer reads it:
    without ``loss_fn`` the inputs are the whole dict (the model computes its loss from the labels; see
    :func:`_own_loss`); with one, the labels are taken out of the inputs and handed to it as the targets (the HF
    Trainer's ``compute_loss_func``). A ``BatchEncoding`` becomes a plain dict, which the device move walks into,
    also as the inputs of a pair (``(tokenizer(texts, return_tensors="pt"), labels)``).

    Example:
        >>> b = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)}
        >>> sorted(_split(b)[0]), sorted(_split(b, loss_fn_given=True)[0])
        (['input_ids', 'labels'], ['input_ids'])
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not isinstance(batch, str):
        return _plain(batch[0]), _plain(batch[1])
    if isinstance(batch, Mapping) and LABELS in batch:
        inputs = {k: v for k, v in batch.items() if not (loss_fn_given and k == LABELS)}
        return inputs, batch[LABELS]
    if isinstance(batch, Mapping):
        got = f"a dict with keys {sorted(map(str, batch))[:6]}"
    elif isinstance(batch, (tuple, list)):
        got = f"a {type(batch).__name__} of {len(batch)} items"
        if len(batch) > 2:  # a Dataset's (image, label, path): keep the pair
            got += " (for (inputs, targets, extra...) yield ((x, y) for x, y, *_ in loader))"
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [f.name for f in dataclasses.fields(batch)]
        got = (f"a {type(batch).__name__} dataclass with fields {fields[:6]} (yield it as (batch, batch.{fields[-1]}) "
               "for a model that takes the whole batch)") if fields else f"a {type(batch).__name__} dataclass"
    else:
        got = type(batch).__name__
    raise UsageError(f"the Trainer takes batches (inputs, targets); the data yielded {got}: yield pairs, e.g. "
                     "((b['pixel_values'], b['label']) for b in loader), or a dict with the targets under 'labels' (a "
                     "Hugging Face DataCollator's batch: model(**batch) computes its own loss); inputs may be a "
                     "tensor, a tuple of tensors (model(*inputs)) or a dict of them (model(**inputs))")


def _plain(x: Any) -> Any:
    """A mapping torch's pytree does not walk (a Hugging Face ``BatchEncoding``, a ``UserDict``) as a plain dict: the
    tokenizer's output handed over whole was one opaque leaf, never moved to the device nor counted (0 samples, and
    fit's epoch loss a NaN read as "training diverged")."""
    return dict(x) if isinstance(x, Mapping) and tree_is_leaf(x) else x


def _uses_own_loss(batch: Any, loss_fn_given: bool) -> bool:
    """Whether the step's loss is the model's own: a dict batch with ``"labels"`` and no ``loss_fn``."""
    return not loss_fn_given and isinstance(batch, Mapping) and LABELS in batch


def _own_loss(out: Any) -> torch.Tensor:
    """The loss a model computed itself from the batch's labels: ``out.loss`` of a Hugging Face ModelOutput (or
    ``out["loss"]`` of a dict), as the HF Trainer takes it.

    Example:
        >>> float(_own_loss({"loss": torch.tensor(0.5), "logits": torch.zeros(2, 3)}))
        0.5
    """
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"the batch is a dict with 'labels', given whole to the model (model(**batch)), and its "
                         f"output ({type(out).__name__}) holds no 'loss' (found {type(loss).__name__}); use a model "
                         "that computes its loss from labels (a Hugging Face ...ForSequenceClassification / "
                         "...ForCausalLM, return_dict=True), or pass loss_fn=lambda out, labels: ... which then gets "
                         "batch['labels']")
    return loss


def _scores(out: Any) -> Any:
    """The class scores in a model's output: a tensor itself, or the ``logits`` of a ModelOutput or dict (None if
    it has none): what top-1 accuracy reads.

    Example:
        >>> _scores({"logits": torch.zeros(2, 3)}).shape
        torch.Size([2, 3])
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        return out.get("logits")
    return getattr(out, "logits", None)


def _call(model: Any, x: Any) -> Any:
    """``model`` on inputs that are a tensor, a tuple of tensors (positional) or a dict of them (keywords)."""
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def _leaves(x: Any) -> list[torch.Tensor]:
    """The tensors of a batch or an output: in tuples, dicts, namedtuples, ModelOutputs and a user's ``@dataclass``
    (which torch's pytree hands over whole, so its tensors were never moved to the device nor counted)."""
    return tensor_leaves(x)


def _movable(x: Any) -> bool:
    """Whether a leaf of a batch goes to the device: a tensor, or an object with its own ``to(device)`` that pytree
    cannot walk (a torch_geometric ``Batch``, a DGL graph), which accelerate's ``send_to_device`` and Lightning's
    ``move_data_to_device`` move too."""
    if isinstance(x, torch.Tensor):
        return True
    return callable(getattr(x, "to", None)) and not isinstance(x, (type, str, bytes, torch.nn.Module))


def _send(x: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """One leaf on ``device``: a tensor, or an object's own ``to`` (with ``non_blocking`` where it takes it)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=non_blocking)
    try:
        return x.to(device, non_blocking=non_blocking)
    except TypeError:  # a to(device) without the keyword, as accelerate's send_to_device falls back
        return x.to(device)


def _to(x: Any, move: Any) -> Any:
    """``move`` applied to every tensor and self-moving object inside ``x`` (dataclass instances included); other
    leaves (strings, ints) as they are."""
    return map_tensors(lambda t: move(t) if _movable(t) else t, x)


def _rows(x: Any, y: Any = None) -> int:
    """The batch size: the first dim of the inputs' first tensor of one dim or more, else of the targets' (inputs
    that hold no tensor pytree can see: a graph batch's object), else 0.

    Example:
        >>> _rows({"step": torch.tensor(3), "x": torch.zeros(5, 2)}), _rows(object(), torch.zeros(4))
        (5, 4)
    """
    for part in (x, y):
        t = next((v for v in _leaves(part) if v.dim() > 0), None)
        if t is not None:
            return int(t.shape[0])
    return 0


def _float_output(out: Any, loss_fn_given: bool) -> Any:
    """A tensor output in float32 for the loss; a structured one (a tuple, a dict, a Hugging Face ModelOutput) is
    handed to ``loss_fn`` as it is, which must then be the user's own."""
    if isinstance(out, torch.Tensor):
        return out.float()
    if not loss_fn_given:
        raise UsageError(f"the model returns a {type(out).__name__}, not a tensor of scores: pass loss_fn=... that "
                         "takes it, e.g. loss_fn=lambda out, y: F.cross_entropy(out.logits, y)")
    return out


def _set_epoch(data: Any, epoch: int) -> None:
    """Tell the data which epoch starts, as a torch loop calls ``sampler.set_epoch(epoch)``: on the data itself
    (overdrive.data.ImageLoader) or, for a DataLoader, on each of its sampler, its batch sampler (a bucketing batch
    sampler of its own), the batch sampler's sampler (DistributedSampler, ResumableSampler) and its dataset (a
    Hugging Face streaming IterableDataset, whose shuffle buffer is seeded by the epoch) that has one, as accelerate's
    DataLoaderShard does. Without it every epoch had the first one's order and crops.

    Example:
        >>> class Epochs:
        ...     def set_epoch(self, epoch): self.epoch = epoch
        >>> loader = torch.utils.data.DataLoader(Epochs(), batch_sampler=Epochs())
        >>> _set_epoch(loader, 3); loader.dataset.epoch, loader.batch_sampler.epoch
        (3, 3)
    """
    if callable(getattr(data, "set_epoch", None)):
        data.set_epoch(epoch)
        return
    batch_sampler = getattr(data, "batch_sampler", None)
    done: set[int] = set()
    for obj in (getattr(data, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
                getattr(data, "dataset", None)):
        if obj is not None and id(obj) not in done and callable(getattr(obj, "set_epoch", None)):
            done.add(id(obj))
            obj.set_epoch(epoch)


def _resumable_sampler(data: Any) -> Any:
    """The ``overdrive.distributed.ResumableSampler`` that orders ``data`` (itself, a DataLoader's sampler or its batch
    sampler's sampler), or None. :meth:`Trainer.fit` advances it after each batch, so its ``state_dict`` saved
    mid-epoch names the samples already trained on. A DataLoader whose batch size is not the sampler's is refused:
    each batch would consume another count of samples than the sampler records."""
    import sys

    module = sys.modules.get("overdrive.distributed.sampler")
    if module is None:  # never imported: no ResumableSampler exists in this process
        return None
    batch_sampler = getattr(data, "batch_sampler", None)
    for obj in (data, getattr(data, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(obj, module.ResumableSampler):
            loader_batch = getattr(data, "batch_size", None) or getattr(batch_sampler, "batch_size", None)
            if obj is not data and isinstance(loader_batch, int) and loader_batch != obj.batch_size:
                raise UsageError(f"the DataLoader's batch_size={loader_batch} differs from its ResumableSampler's "
                                 f"batch_size={obj.batch_size}, which counts the samples each batch consumes (for a "
                                 "resume); give both the same per-rank batch size")
            return obj
    return None


def _mark_last(data: Iterable[Batch]) -> Iterator[tuple[Batch, bool]]:
    """Each batch with whether it is the last one (one batch of look-ahead: works without ``len``). Not for data
    that records its position (:func:`_records_position`): the batch read ahead counts as taken."""
    it = iter(data)
    try:
        prev = next(it)
    except StopIteration:
        return
    for batch in it:
        yield prev, False
        prev = batch
    yield prev, True


def _records_position(data: Any) -> bool:
    """Whether ``data`` records its own position in the epoch (a ``state_dict()``: overdrive.data.ImageLoader,
    torchdata's StatefulDataLoader, a Hugging Face IterableDataset). :func:`_mark_last`'s read-ahead would have it
    count a batch more than was trained, and a resume from its ``state_dict`` skip that batch."""
    return callable(getattr(data, "state_dict", None))


def _len_or_none(data: Iterable[Any]) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
