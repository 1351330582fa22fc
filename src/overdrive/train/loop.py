"""A small, readable training loop on overdrive.amp: one step is visible in :meth:`Trainer.train_step`."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.timing import synchronize
from overdrive.amp import MixedPrecision, Policy, prepare
from overdrive.train.config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor]
BAR_SECONDS = 0.5  # fit's progress bar shows the loss and throughput at most this often (each read is a host sync)


@dataclass
class EpochStats:
    epoch: int
    loss: float  # mean training loss over the epoch
    samples: int
    seconds: float
    skipped_steps: int
    eval_loss: float | None = None
    eval_accuracy: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


def _mean_over_ranks(value: float, device: torch.device) -> float:
    """``value`` averaged over the ranks of the default process group (itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


@dataclass
class FitResult:
    history: list[EpochStats] = field(default_factory=list)
    peak_memory_mib: float = 0.0

    @property
    def final_loss(self) -> float:
        return self.history[-1].loss

    @property
    def samples_per_s(self) -> float:
        """Throughput over all epochs but the first (warm-up), or over the only one."""
        timed = self.history[1:] or self.history
        return sum(e.samples for e in timed) / max(sum(e.seconds for e in timed), 1e-12)


class Trainer:
    """Model + optimizer + amp policy, with a visible step, a fit loop, evaluation and checkpoints.

    The settings are a :class:`~overdrive.train.TrainConfig` (``trainer.config``): give one as ``config``,
    keywords (``policy=``, ``accumulate=``, ...; each replaces that field of ``config`` or of the defaults),
    or both. The objects the loop works on (model, optimizer, ``loss_fn``, ``scheduler``) are arguments;
    ``scheduler_interval`` says when the scheduler steps: "step" (after each optimizer step, the default) or
    "epoch" (at the end of each :meth:`fit` epoch: ``StepLR(opt, step_size=30)`` meaning 30 epochs).

    Batches are ``(inputs, targets)``: inputs a tensor, a tuple of tensors (``model(*inputs)``) or a dict of them
    (``model(**inputs)``); a model that returns a dict or a Hugging Face ModelOutput hands it to ``loss_fn`` as it is.
    ``device`` moves the model there (batches follow); without it, the model's device is used.
    ``compile=True`` compiles the model's forward with torch.compile (the step stays eager, so
    the loss scaler and optimizer hooks behave as usual). ``strategy="ddp"|"fsdp"`` (or an
    ``overdrive.distributed.Strategy``) spreads the model over the process group; see
    ``overdrive/distributed/README.md``.

    Example:
        >>> model = nn.Linear(4, 3)
        >>> t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=Policy(opt_level="O1", dtype=torch.bfloat16), progress=False)
        >>> loss = t.train_step((torch.randn(8, 4), torch.randint(0, 3, (8,))))
        >>> t2 = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainConfig(accumulate=2), progress=False)
        >>> t2.config.accumulate, t2.config.progress
        (2, False)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> t3 = Trainer(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=30),
        ...              scheduler_interval="epoch", progress=False)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig | Policy | str | None = None,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        scheduler: Any | None = None,
        scheduler_interval: str = "step",
        **settings: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"model={type(model).__name__} is not a torch.nn.Module; pass the model to train")
        if not isinstance(optimizer, torch.optim.Optimizer):
            # None trained nothing: every step found no optimizer to step, and the loss stayed where it was
            raise UsageError(f"optimizer={optimizer!r} is not a torch.optim.Optimizer; pass one built on the model's "
                             "parameters, e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)")
        if isinstance(config, (Policy, str)):  # the old third positional argument: the amp policy
            if "policy" in settings:
                raise UsageError(f"the policy is given twice: {config!r} as the third argument and "
                                 f"policy={settings['policy']!r}; give one")
            settings["policy"] = config
            config = None
        elif config is not None and not isinstance(config, TrainConfig):
            raise UsageError(f"config={config!r} must be an overdrive.train.TrainConfig (or an amp policy)")
        # one validated, frozen record of the settings; an unknown keyword is a UsageError naming the known ones
        self.config = cfg = (config if config is not None else TrainConfig()).replace(**settings)
        policy, device, strategy, accumulate = cfg.policy, cfg.device, cfg.strategy, cfg.accumulate
        first = next(model.parameters(), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
        if device is not None:
            # As accelerate / the HF Trainer do: the model goes where the batches go. Module.to
            # keeps the Parameter objects only between compatible tensor types (CPU <-> CUDA, not
            # to 'meta' or some backends); where it made new ones, the optimizer is re-pointed at them.
            from overdrive.distributed.parallel import _rebind_optimizer

            names = {id(q): n for n, q in model.named_parameters()}
            model.to(self.device)
            mine = {id(q) for q in model.parameters()}
            if any(id(q) not in mine for g in optimizer.param_groups for q in g["params"]):
                if len(optimizer.state) > 0:
                    raise UsageError(
                        f"device={str(self.device)!r} re-created the model's parameters, and the optimizer has already "
                        "stepped (its state belongs to the old ones); build the optimizer after moving the model, or "
                        "before its first step"
                    )
                optimizer = _rebind_optimizer(optimizer, names, model)
        mine = {id(q) for q in model.parameters()}
        if mine and not any(id(q) in mine for g in optimizer.param_groups for q in g["params"]):
            # e.g. an optimizer built on another model, or on this one before a deepcopy: no step changes this model
            raise UsageError(
                f"the optimizer holds {sum(len(g['params']) for g in optimizer.param_groups)} parameter(s), none of "
                f"them the model's ({len(mine)}); build it on this model's parameters, e.g. "
                f"torch.optim.{type(optimizer).__name__}(model.parameters(), ...)"
            )
        # checked before sharding and prepare: a refused Trainer leaves the model and the optimizer as they were (a retry said "already prepared")
        if loss_fn is not None and not callable(loss_fn):
            raise UsageError(f"loss_fn={loss_fn!r} is not callable; pass a function of (output, target), e.g. "
                             "torch.nn.functional.cross_entropy or torch.nn.CrossEntropyLoss()")
        if isinstance(loss_fn, type):
            # a class passed the callable check and failed at the first step ("Boolean value of Tensor ... ambiguous")
            raise UsageError(f"loss_fn={loss_fn.__name__} is a class; pass an instance, e.g. {loss_fn.__name__}(), or a "
                             "function of (output, target)")
        if scheduler is not None:
            if not callable(getattr(scheduler, "step", None)):
                raise UsageError(f"scheduler={scheduler!r} is not an LR scheduler; pass one built on this optimizer, e.g. "
                                 "torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)")
            if getattr(scheduler, "optimizer", optimizer) is not optimizer:
                # it stepped another optimizer's learning rate: this one trained at a constant rate, silently
                raise UsageError(f"the scheduler ({type(scheduler).__name__}) was built on another optimizer than the "
                                 "one given; build it on this optimizer (a rebuilt optimizer needs a rebuilt scheduler)")
        if scheduler_interval not in ("step", "epoch"):
            raise UsageError(f"scheduler_interval={scheduler_interval!r} must be 'step' (scheduler.step() after each "
                             "optimizer step) or 'epoch' (once at the end of each fit epoch, e.g. for StepLR(step_size=30) "
                             "counted in epochs)")
        # strategy='ddp'|'fsdp' (or an overdrive.distributed.Strategy): see overdrive/distributed/parallel.py
        self.parallel = None
        if strategy is not None:
            from overdrive.distributed.parallel import Parallel

            self.parallel = Parallel(strategy, self.device, accumulate)
            model, optimizer, policy = self.parallel.before_amp(model, optimizer, policy)
        self.model = model
        self.optimizer = optimizer
        self.mp: MixedPrecision = prepare(model, optimizer, policy, device=self.device, autocast_hooks=False)
        if self.device.type == "cuda":
            # no host sync per step: the inf/NaN flag is read a step late and a fused optimizer skips a bad step on
            # the device (GradScaler's way). Synced once per step, the GPU idled while the host launched the next
            # step: the demo's ResNet-18 O2 + compile ran 0.74-0.84x the hand-written loop.
            self.mp.defer_checks()
        self._skips_before = self.mp.skipped_steps
        if self.parallel is not None:
            model = self.parallel.after_amp(model, self.mp.policy)
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self._loss_fn_given = loss_fn is not None
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.grad_clip = cfg.grad_clip
        self.accumulate = accumulate
        self.progress = cfg.progress
        self.channels_last = cfg.channels_last
        self.forward = _compiled(model, whole_call=self.parallel is None) if cfg.compile else model
        self.step_count = 0  # optimizer steps taken (skipped ones included)
        # ReduceLROnPlateau needs a metric: fit steps it once per epoch, train_step never
        self._plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.epoch = 0
        self._micro = 0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps this trainer skipped for an inf/NaN gradient or loss."""
        return self.mp.skipped_steps - self._skips_before

    @property
    def micro_step(self) -> int:
        """Micro-batches run so far (``train_step`` calls, a partial accumulation counted up to its end);
        ``micro_step % accumulate`` is the position inside the current accumulation (0: at a step boundary)."""
        return self._micro

    @micro_step.setter
    def micro_step(self, value: int) -> None:  # a resumed checkpoint puts the loop back where it was
        self._micro = int(value)

    # --- one step, in plain sight -----------------------------------------------------------
    def _move(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(self.device, non_blocking=True)
        return t.contiguous(memory_format=torch.channels_last) if self.channels_last and t.dim() == 4 else t

    def _to_device(self, x: Any) -> Any:
        """Inputs (a tensor, or tensors in a tuple or dict) on the device; 4-D ones channels-last if asked."""
        return self._move(x) if isinstance(x, torch.Tensor) else tree_map(self._move, x)  # a tensor: no pytree walk

    def train_step(self, batch: Batch, end_of_epoch: bool = False) -> torch.Tensor:
        """Forward, scaled backward, (every ``accumulate`` micro-batches) clip, step and step the
        scheduler (not a ``ReduceLROnPlateau`` or one with ``scheduler_interval="epoch"``: :meth:`fit` steps those once
        per epoch).

        ``end_of_epoch=True`` (what :meth:`fit` passes with an epoch's last batch) also steps a
        partial accumulation of k < ``accumulate`` micro-batches, on the mean of their gradients,
        so no gradient carries into the next epoch.

        An inf/NaN loss or gradient is reported by the call that steps (with ``accumulate`` > 1, the
        one closing the micro-batch's accumulation), naming ``step_count``: that step is not applied;
        the policy's ``on_nonfinite`` says whether it is skipped, counted in ``skipped_steps`` and warned
        about ("skip", the default) or raises an OverdriveError ("raise"). The check is amp's: on the CPU
        one host read per step; on CUDA none (``MixedPrecision.defer_checks``: a fused optimizer skips the step on
        the device, and the warning comes a step late, at the next backward, naming this step).

        A batch of no samples (``x.shape[0] == 0``) contributes a zero gradient and reports a NaN loss; the step
        is taken as usual, so every rank of a DDP/FSDP job steps alike.

        Returns the micro-batch loss as a detached tensor (no host sync of its own).
        """
        x, y = _split(batch)
        x = self._to_device(x)
        y = (y.to(self.device, non_blocking=True) if isinstance(y, torch.Tensor)
             else tree_map(lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, y))
        k = self._micro % self.accumulate + 1  # micro-batches in this accumulation, this one included
        last = k == self.accumulate or end_of_epoch
        first = next((t for t in _leaves(x) if isinstance(t, torch.Tensor)), None)
        empty = first is not None and first.dim() > 0 and first.shape[0] == 0
        with self._grad_sync(last):
            with self.mp.autocast():
                out = _call(self.forward, x)
                # a batch of no samples: overdrive.data yields one when every file of it was undecodable, so
                # that the ranks keep the same step count. Its mean loss is NaN, which made this rank skip the
                # step while the others applied theirs: DDP replicas drifted apart. It backpropagates a zero
                # gradient instead (every parameter reached, so DDP's and FSDP's collectives still match) and
                # reports a NaN loss, which fit leaves out of the epoch's mean; loss_fn is not called on it.
                out = _float_output(out, self._loss_fn_given)
                if empty:
                    loss = sum(t.float().sum() for t in _leaves(out) if isinstance(t, torch.Tensor)) * 0.0
                else:
                    loss = self.loss_fn(out, y)
                    if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() != 1:
                        raise UsageError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not one value; reduce "
                                         "it (reduction='mean', or .mean() in the function)")
            self.mp.backward(loss / self.accumulate if self.accumulate > 1 else loss)
            if empty:
                loss = torch.full((), math.nan, device=loss.device)
        self._micro += 1
        if last:
            if self.parallel is not None:
                self.parallel.finish_accumulation(self.mp.master_params())
            if k < self.accumulate:
                # A partial accumulation: each loss was divided by ``accumulate``; make the step's
                # gradient the mean over the k micro-batches it holds, and start the next
                # accumulation afresh (``_micro`` to the next multiple of ``accumulate``).
                for q in self.mp.master_params():
                    if q.grad is not None:
                        q.grad.mul_(self.accumulate / k)
                self._micro += self.accumulate - k
            if self.grad_clip is not None:
                self.mp.clip_grad_norm_(self.grad_clip)
            # inf/NaN: not applied (warned or raised, a step late when the checks are deferred; skipped_steps counts it)
            self.mp.step(number=self.step_count, wait=False)
            if self.parallel is not None:
                self.parallel.after_step()
            self.mp.zero_grad()
            if self.scheduler is not None and not self._plateau and self.scheduler_interval == "step":
                self.scheduler.step()
            self.step_count += 1
        return loss.detach()

    def _grad_sync(self, last: bool) -> Any:
        return self.parallel.accumulation(last) if self.parallel is not None else contextlib.nullcontext()

    # --- the loop ---------------------------------------------------------------------------
    def fit(
        self,
        train_data: Iterable[Batch],
        epochs: int,
        eval_data: Iterable[Batch] | None = None,
        on_epoch_end: Callable[[EpochStats], None] | None = None,
        description: str = "train",
    ) -> FitResult:
        """Train for ``epochs`` epochs; returns per-epoch loss, throughput and eval metrics.

        With ``accumulate`` > 1, an epoch whose batch count is not a multiple of it ends with a
        step on the mean gradient of its last k < ``accumulate`` micro-batches (as Lightning and the
        HF Trainer do), so each epoch's gradients stay in that epoch.

        Schedulers step once per optimizer step (in :meth:`train_step`), or, with
        ``Trainer(..., scheduler_interval="epoch")``, once at the end of each epoch (after its evaluation),
        as a torch loop with ``StepLR(opt, step_size=30)`` counted in epochs does. ``ReduceLROnPlateau``
        needs a metric: it steps once at the end of each epoch, on the eval loss when ``eval_data`` is
        given and otherwise on the epoch's mean training loss.

        Under ``strategy="ddp"|"fsdp"``, each epoch starts by checking that every rank's ``train_data`` has the same
        number of batches (where it has a ``len``): uneven counts raise ``UsageError`` on every rank.

        Each epoch starts with ``set_epoch(trainer.epoch)`` on ``train_data`` when it has one (an
        ``overdrive.data.ImageLoader``), else on its sampler (a DataLoader over a ``DistributedSampler`` or
        ``ResumableSampler``), as a hand-written torch loop does: each epoch gets its own shuffle.

        A step with an inf/NaN loss or gradient is reported as it happens (see :meth:`train_step`); with
        ``on_nonfinite="skip"`` it is skipped and the epoch's mean loss is over its finite losses. An epoch
        with no finite loss raises "training diverged".
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise UsageError(f"epochs={epochs!r} must be an int >= 1")
        if not isinstance(train_data, Iterable) or isinstance(train_data, (str, bytes)):
            raise UsageError(f"train_data={train_data!r} is not an iterable of batches; pass a DataLoader, an "
                             "ImageLoader or a list of (inputs, targets), e.g. fit(loader, epochs=3)")
        if epochs > 1 and isinstance(train_data, Iterator):  # its second epoch would find it used up
            raise UsageError(f"train_data is a one-shot iterator ({type(train_data).__name__}), which epochs={epochs} "
                             "would find empty after the first epoch; pass a list, a DataLoader or an ImageLoader "
                             "(re-iterable), or call fit(..., epochs=1) once per fresh iterator")
        result = FitResult()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        total = _len_or_none(train_data)
        with _progress(self.progress, description) as bar:
            task = bar.add_task(description, total=(total * epochs) if total else None, loss=float("nan"), tput=0.0) if bar else None
            for _ in range(epochs):
                _set_epoch(train_data, self.epoch)
                if self.parallel is not None:  # uneven batch counts over ranks: an error here, not a hang mid-epoch
                    self.parallel.check_same_batches(_len_or_none(train_data), self.epoch)
                self.model.train()
                skipped0 = self.skipped_steps
                losses: list[torch.Tensor] = []
                sizes: list[int] = []  # each step's batch size: the epoch loss is a mean over samples, as evaluate's
                samples = 0
                synchronize(self.device)
                t0 = shown = time.perf_counter()
                on_bar = 0  # this epoch's steps the bar has counted
                for batch, end in _mark_last(train_data):
                    losses.append(self.train_step(batch, end_of_epoch=end))
                    sizes.append(_rows(_split(batch)[0]))
                    samples += sizes[-1]
                    if bar is not None and time.perf_counter() - shown >= BAR_SECONDS:
                        # reading the loss waits for the device: at most once per BAR_SECONDS, not every few steps
                        shown = time.perf_counter()
                        bar.update(task, advance=len(losses) - on_bar, loss=float(losses[-1]), tput=samples / (shown - t0))
                        on_bar = len(losses)
                synchronize(self.device)
                seconds = time.perf_counter() - t0
                if not losses:
                    raise UsageError("the training data yielded no batch; check the dataset and batch size (or, for "
                                     "an iterator or generator, that an earlier fit did not use it up)")
                # (n,): the steps with an inf/NaN loss were not applied (amp's guard skipped them), so
                # the mean is over the finite ones
                stacked = torch.stack(losses).float()
                finite = torch.isfinite(stacked)
                weights = torch.tensor(sizes, dtype=torch.float32, device=stacked.device)[finite]
                mean_loss = (float((stacked[finite] * weights).sum() / weights.sum()) if bool(finite.any())
                             else math.nan)
                if not math.isfinite(mean_loss):
                    raise OverdriveError(
                        f"training diverged: no finite loss in epoch {self.epoch}; lower the learning rate, check the "
                        "data, or use a dynamic loss scale"
                    )
                stats = EpochStats(self.epoch, mean_loss, samples, seconds, self.skipped_steps - skipped0)
                if eval_data is not None:
                    stats.eval_loss, stats.eval_accuracy = evaluate(
                        self.model, eval_data, self.mp, self.channels_last, loss_fn=self.loss_fn
                    )
                if self._plateau:
                    metric = stats.eval_loss if stats.eval_loss is not None else mean_loss
                    # each rank's loss is its own shard's: stepped on it, ranks lowered their lr at different epochs
                    # and the DDP / FSDP replicas drifted apart; the mean over ranks gives every rank one lr
                    self.scheduler.step(_mean_over_ranks(metric, self.device) if self.parallel is not None else metric)
                elif self.scheduler is not None and self.scheduler_interval == "epoch":
                    self.scheduler.step()  # after the epoch's eval, as a hand-written torch loop steps an epoch scheduler
                if bar is not None:
                    bar.update(task, completed=(self.epoch + 1) * total if total else None, loss=mean_loss, tput=stats.samples_per_s)
                result.history.append(stats)
                self.epoch += 1
                if on_epoch_end is not None:
                    on_epoch_end(stats)
        result.peak_memory_mib = memory_mib(self)
        return result

    # --- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, including the gradients of a half-done accumulation."""
        mid_accumulation = self._micro % self.accumulate != 0
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "amp": self.mp.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "epoch": self.epoch,
            "step": self.step_count,
            "micro": self._micro,
            # None at a step boundary, where zero_grad left nothing pending
            "pending": self.mp.pending_state() if mid_accumulation else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into this trainer (built the same way)."""
        self.model.load_state_dict(state["model"])
        # O2: groups added since prepare (a backbone unfrozen with add_param_group) get their fp32 masters before the
        # optimizer's state is loaded onto them; after, amp took them for stepped parameters and made none
        self.mp.master_pairs()
        self.optimizer.load_state_dict(state["optimizer"])
        self.mp.load_state_dict(state["amp"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.step_count, self._micro = state["epoch"], state["step"], state["micro"]
        if state.get("pending") is not None:
            self.mp.load_pending_state(state["pending"])
        else:
            # grads this trainer holds from before the load must not leak into the resumed step
            self.mp.zero_grad()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Iterable[Batch],
    mp: MixedPrecision | None = None,
    channels_last: bool = False,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[float, float | None]:
    """Mean loss and top-1 accuracy of ``model`` over ``data`` (under ``mp``'s autocast if given). The accuracy is
    None unless every batch is (N, C) class scores against (N,) integer targets (binary logits, per-token outputs
    and regression have no top-1 accuracy).

    ``loss_fn(output, target)`` is called as in training and must return the batch *mean* (the
    convention of torch's losses); each batch is weighted by its size, so the result is the mean
    over samples. Without it, the loss is cross-entropy.

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
    ctx = mp.autocast if mp is not None else None
    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t

    for batch in data:
        x, y = _split(batch)
        x, y = tree_map(move, x), tree_map(move, y)
        if ctx is not None:
            with ctx():
                out = _call(model, x)
        else:
            out = _call(model, x)
        out = _float_output(out, loss_fn is not None)
        rows = _rows(x)
        if loss_fn is None:
            total_loss += nn.functional.cross_entropy(out, y, reduction="sum").double()
        else:
            # a user loss has no ``reduction`` argument: undo its batch mean
            total_loss += loss_fn(out, y).double() * rows
        if classifies and isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor) and _is_classification(out, y):
            correct += (out.argmax(dim=-1) == y).sum()
        else:  # one logit per sample (BCE), per-token outputs, regression: top-1 accuracy is not defined here
            classifies = False
        n += rows
    model.train(was_training)
    if n == 0:
        raise UsageError("the evaluation data yielded no sample")
    return float(total_loss) / n, float(correct) / n if classifies else None


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


def _split(batch: Any) -> tuple[Any, Any]:
    """A batch as (inputs, targets), or a one-line error saying what the Trainer takes."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not isinstance(batch, str):
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        got = f"a dict with keys {sorted(map(str, batch))[:6]}"
    elif isinstance(batch, (tuple, list)):
        got = f"a {type(batch).__name__} of {len(batch)} items"
    else:
        got = type(batch).__name__
    raise UsageError(f"the Trainer takes batches (inputs, targets); the data yielded {got}: yield pairs, e.g. "
                     "((b['input_ids'], b['labels']) for b in loader); inputs may be a tensor, a tuple of tensors "
                     "(model(*inputs)) or a dict of them (model(**inputs))")


def _call(model: Any, x: Any) -> Any:
    """``model`` on inputs that are a tensor, a tuple of tensors (positional) or a dict of them (keywords)."""
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def _leaves(x: Any) -> list[Any]:
    return [x] if isinstance(x, torch.Tensor) else tree_leaves(x)  # a tensor (the common batch): no pytree walk


def _rows(x: Any) -> int:
    """The batch size of inputs (the first dim of their first tensor; 0 for none or a 0-d one)."""
    t = next((v for v in _leaves(x) if isinstance(v, torch.Tensor)), None)
    return int(t.shape[0]) if t is not None and t.dim() > 0 else 0


def _float_output(out: Any, loss_fn_given: bool) -> Any:
    """A tensor output in float32 for the loss; a structured one (a tuple, a dict, a Hugging Face ModelOutput) is
    handed to ``loss_fn`` as it is, which must then be the user's own."""
    if isinstance(out, torch.Tensor):
        return out.float()
    if not loss_fn_given:
        raise UsageError(f"the model returns a {type(out).__name__}, not a tensor of scores: pass loss_fn=... that "
                         "takes it, e.g. loss_fn=lambda out, y: F.cross_entropy(out.logits, y)")
    return out


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


def _compiled(model: nn.Module, whole_call: bool) -> Callable[..., Any]:
    """``model`` under torch.compile. ``whole_call``: compile the call ``model(x)`` itself, so the module's own
    forward hooks (amp's O2 input and output casts) are traced into the one graph. ``torch.compile(model)`` runs
    the hooks of a module whose class is not torch's outside the compiled forward, where each is compiled as a
    graph of its own: three graphs, three autograd functions and three guard checks a step instead of one.
    A DDP / FSDP module keeps ``torch.compile(model)``, whose handling of their hooks is torch's."""
    if not whole_call:
        return torch.compile(model)

    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    # torch.compile keeps its compiled entries per code object, and reaches its recompile limit (8) on one: were every
    # Trainer's call to share this function's code, a process that trains 9 model classes would run the 9th uncompiled.
    # One code object per model class, as torch.compile(model) has one per class's forward: models of one class share
    # their graphs (a sweep compiles once), models of other classes do not crowd them out.
    call.__code__ = _CALL_CODE.setdefault(type(model), call.__code__.replace())
    return torch.compile(call)


_CALL_CODE: dict[type, Any] = {}  # _compiled's code object of the call, per model class


def _set_epoch(data: Any, epoch: int) -> None:
    """Tell the data which epoch starts, as a torch loop calls ``sampler.set_epoch(epoch)``: on the data itself
    (overdrive.data.ImageLoader) or, for a DataLoader, on its sampler or its batch sampler's sampler
    (DistributedSampler, ResumableSampler). Without it every epoch had the first one's order and crops."""
    for obj in (data, getattr(data, "sampler", None), getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)
            return


def _mark_last(data: Iterable[Batch]) -> Iterator[tuple[Batch, bool]]:
    """Each batch with whether it is the last one (one batch of look-ahead: works without ``len``)."""
    it = iter(data)
    try:
        prev = next(it)
    except StopIteration:
        return
    for batch in it:
        yield prev, False
        prev = batch
    yield prev, True


def _len_or_none(data: Iterable[Any]) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _progress(enabled: bool, description: str) -> Any:
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tput]:,.0f} samples/s"),
        TimeElapsedColumn(), transient=True,
    )
