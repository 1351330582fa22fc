"""A small, readable training loop on overdrive.amp: one step is visible in :meth:`Trainer.train_step`, one epoch in
:meth:`Trainer.fit`. What fit reports is in ``stats.py``, evaluation in ``evaluation.py``, how a batch is read in
``batches.py`` and early stopping in ``early_stopping.py``; their public names are importable from here too."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import OverdriveError, UsageError
from overdrive._utils.timing import synchronize
from overdrive.amp import MixedPrecision, Policy, prepare
from overdrive.train.batches import (  # noqa: F401  (_is_classification and the helpers: importable from here as before)
    Batch, _call, _float_output, _len_or_none, _leaves, _mark_last, _movable, _own_loss, _records_position,
    _resumable_sampler, _rows, _send, _set_epoch, _split, _to, _uses_own_loss,
)
from overdrive.train.config import TrainConfig
from overdrive.train.early_stopping import EarlyStopping
from overdrive.train.evaluation import _is_classification, evaluate, memory_mib  # noqa: F401
from overdrive.train.stats import EpochStats, FitResult
from overdrive.train.stats import mean_over_ranks as _mean_over_ranks

BAR_SECONDS = 0.5  # fit's progress bar shows the loss and throughput at most this often (each read is a host sync)


class Trainer:
    """Model + optimizer + amp policy, with a visible step, a fit loop, evaluation and checkpoints.

    The settings are a :class:`~overdrive.train.TrainConfig` (``trainer.config``): give one as ``config``,
    keywords (``policy=``, ``accumulate=``, ...; each replaces that field of ``config`` or of the defaults),
    or both. The objects the loop works on (model, optimizer, ``loss_fn``, ``scheduler``) are arguments;
    ``scheduler_interval`` says when the scheduler steps: "step" (after each optimizer step, the default) or
    "epoch" (at the end of each :meth:`fit` epoch: ``StepLR(opt, step_size=30)`` meaning 30 epochs).

    Batches are ``(inputs, targets)``: inputs a tensor, a tuple of tensors (``model(*inputs)``) or a dict of them
    (``model(**inputs)``), or any other object for ``model(inputs)``; tensors nested in tuples, dicts and a user's
    ``@dataclass`` go to the device, as does an object with its own ``to(device)`` (a graph batch). A model that
    returns a dict, a dataclass or a Hugging Face ModelOutput hands it to ``loss_fn`` as it is.
    A dict with ``"labels"`` (a Hugging Face DataCollator's batch) is read as the HF Trainer reads it: without
    ``loss_fn`` the loss is the model's own (``model(**batch).loss``); with one, ``loss_fn(model(**rest), labels)``.
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
        self.epoch = 0  # epochs fit has finished
        self.should_stop = False  # set (by a callback, or early stopping) to end fit after the current epoch
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
            return _send(t, self.device) if _movable(t) else t  # a graph batch's own to(device)
        t = t.to(self.device, non_blocking=True)
        return t.contiguous(memory_format=torch.channels_last) if self.channels_last and t.dim() == 4 else t

    def _to_device(self, x: Any) -> Any:
        """Inputs (a tensor, or tensors in a tuple, dict or a user's ``@dataclass``) on the device; 4-D ones
        channels-last if asked."""
        return _to(x, self._move)

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
        own = _uses_own_loss(batch, self._loss_fn_given)  # a Hugging Face dict batch: the model's own loss
        x, y = _split(batch, self._loss_fn_given)
        x = self._to_device(x)
        y = _to(y, lambda t: _send(t, self.device))
        k = self._micro % self.accumulate + 1  # micro-batches in this accumulation, this one included
        last = k == self.accumulate or end_of_epoch
        first = next((t for t in _leaves(x) if t.dim() > 0), None)  # as _rows: a 0-d tensor has no batch dim
        empty = first is not None and first.dim() > 0 and first.shape[0] == 0
        with self._grad_sync(last):
            with self.mp.autocast():
                out = _call(self.forward, x)
                # a batch of no samples: overdrive.data yields one when every file of it was undecodable, so
                # that the ranks keep the same step count. Its mean loss is NaN, which made this rank skip the
                # step while the others applied theirs: DDP replicas drifted apart. It backpropagates a zero
                # gradient instead (every parameter reached, so DDP's and FSDP's collectives still match) and
                # reports a NaN loss, which fit leaves out of the epoch's mean; loss_fn is not called on it.
                out = _float_output(out, self._loss_fn_given or own)
                if empty:
                    loss = sum(t.float().sum() for t in _leaves(out)) * 0.0
                else:
                    loss = _own_loss(out) if own else self.loss_fn(out, y)
                    if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() != 1:
                        raise UsageError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not one value; reduce "
                                         "it (reduction='mean', or .mean() in the function)")
            self.mp.backward(loss / self.accumulate if self.accumulate > 1 else loss)
            if empty:
                loss = torch.full((), math.nan, device=loss.device)
        self._micro += 1
        if last:
            self._step(k)
        return loss.detach()

    def _step(self, k: int) -> None:
        """The optimizer step closing an accumulation of ``k`` micro-batches (their backward already run)."""
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

    def _grad_sync(self, last: bool) -> Any:
        return self.parallel.accumulation(last) if self.parallel is not None else contextlib.nullcontext()

    def _can_close_late(self) -> bool:
        """Whether a partial accumulation can be stepped after its last micro-batch's backward (what fit does for
        data that records its position, read without a batch of look-ahead). Not under FSDP with ``accumulate`` > 1:
        the gradients of micro-batches run without sync are reduce-scattered only by a backward with it."""
        return self.accumulate == 1 or self.parallel is None or self.parallel.strategy.kind != "fsdp"

    def _close_accumulation(self) -> None:
        """Step a partial accumulation left open by the epoch's last batch, as ``end_of_epoch=True`` on that batch
        would have: the same gradients, scale, clip and step."""
        k = self._micro % self.accumulate
        if k == 0:
            return
        with self._grad_sync(True):  # DDP: marks the step's end (buffers broadcast at the next forward), no backward
            pass
        self._step(k)

    # --- the loop ---------------------------------------------------------------------------
    def fit(
        self,
        train_data: Iterable[Batch],
        epochs: int | None = None,
        eval_data: Iterable[Batch] | None = None,
        on_epoch_end: Callable[[EpochStats], bool | None] | None = None,
        description: str = "train",
        *,
        max_epochs: int | None = None,
        early_stopping: EarlyStopping | None = None,
    ) -> FitResult:
        """Train for ``epochs`` more epochs, or up to ``max_epochs`` in all; returns per-epoch loss, throughput and eval
        metrics.

        ``epochs=N`` runs N epochs from where the trainer is, as ``for _ in range(N)`` in a torch loop: after a resume
        at ``trainer.epoch == 3``, ``fit(data, epochs=10)`` runs epochs 3..12. ``max_epochs=N`` (Lightning's
        ``max_epochs``, Keras' ``fit(epochs=N, initial_epoch=k)``) runs epochs ``trainer.epoch``..N-1, so a run
        resumed from any checkpoint ends at the same total; none when ``trainer.epoch >= N``. Give one of the two.

        Stopping early: ``early_stopping=EarlyStopping(monitor="eval_loss", patience=3)`` (see
        :class:`~overdrive.train.EarlyStopping`), or ``on_epoch_end`` returning True, or a callback setting
        ``trainer.should_stop = True``, ends fit after that epoch; ``FitResult.stopped_epoch`` names it. Under
        ``strategy="ddp"|"fsdp"`` the monitored value is averaged over ranks, and a stop asked by any rank stops every
        rank, at the same epoch (one all-reduce per epoch).

        Resuming: ``trainer.epoch`` counts finished epochs. A checkpoint taken mid-epoch (with :meth:`train_step` in a
        hand-written loop) resumes through fit at the start of that epoch's data, unless the data resumes itself: a
        DataLoader over an ``overdrive.distributed.ResumableSampler`` whose ``state_dict`` was saved with the
        checkpoint and loaded back continues where it stopped (fit's ``set_epoch`` with the same epoch keeps its
        position), and then the rest of that epoch equals the uninterrupted run's. fit advances such a sampler after
        each batch it trains on (each micro-batch under ``accumulate``), so a ``state_dict`` taken while fit runs
        (a preemption handler's save) names exactly the samples already trained on. Data that records its own position
        (``overdrive.data.ImageLoader``, torchdata's ``StatefulDataLoader``: a ``state_dict``) is read without a batch
        of look-ahead, so its ``state_dict`` taken between two steps counts exactly the batches trained on too, and
        loading it back resumes the epoch with the next one (not under ``strategy="fsdp"`` with ``accumulate`` > 1,
        which needs the last batch flagged before its backward, so reads one batch ahead). Such a state saved after
        the epoch's last batch (before fit closed the epoch) resumes with an empty pass: fit finishes that epoch as the
        uninterrupted run did (pending accumulation, evaluation, schedulers; no training loss) and goes on.

        With ``accumulate`` > 1, an epoch whose batch count is not a multiple of it ends with a
        step on the mean gradient of its last k < ``accumulate`` micro-batches (as Lightning and the
        HF Trainer do), so each epoch's gradients stay in that epoch (for data read without look-ahead, that step comes
        after the epoch's last batch, on the same gradients).

        Schedulers step once per optimizer step (in :meth:`train_step`), or, with
        ``Trainer(..., scheduler_interval="epoch")``, once at the end of each epoch (after its evaluation),
        as a torch loop with ``StepLR(opt, step_size=30)`` counted in epochs does. ``ReduceLROnPlateau``
        needs a metric: it steps once at the end of each epoch, on the eval loss when ``eval_data`` is
        given and otherwise on the epoch's mean training loss.

        Under ``strategy="ddp"|"fsdp"``, each epoch starts by checking that every rank's ``train_data`` has the same
        number of batches (where it has a ``len``): uneven counts raise ``UsageError`` on every rank.

        Each epoch starts with ``set_epoch(trainer.epoch)`` on ``train_data`` when it has one (an
        ``overdrive.data.ImageLoader``), else on each of a DataLoader's sampler (``DistributedSampler``,
        ``ResumableSampler``), batch sampler, batch sampler's sampler and dataset (a streaming ``IterableDataset``)
        that has one, as a hand-written torch loop (or accelerate) does: each epoch gets its own shuffle.

        A step with an inf/NaN loss or gradient is reported as it happens (see :meth:`train_step`); with
        ``on_nonfinite="skip"`` it is skipped and the epoch's mean loss is over its finite losses. An epoch
        with no finite loss raises "training diverged".
        """
        if (epochs is None) == (max_epochs is None):
            raise UsageError(f"fit(epochs={epochs!r}, max_epochs={max_epochs!r}): give one of them: epochs=N for N more "
                             "epochs, or max_epochs=N to train until trainer.epoch reaches N (the total after a resume); "
                             "each must be an int >= 1")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise UsageError(f"epochs={epochs!r} must be an int >= 1")
        if max_epochs is not None:
            if isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < 1:
                raise UsageError(f"max_epochs={max_epochs!r} must be an int >= 1 (the total number of epochs)")
            epochs = max(0, max_epochs - self.epoch)
        if early_stopping is not None:
            if not isinstance(early_stopping, EarlyStopping):
                raise UsageError(f"early_stopping={early_stopping!r} must be an overdrive.train.EarlyStopping, e.g. "
                                 "EarlyStopping(monitor='eval_loss', patience=3)")
            if early_stopping.monitor.startswith("eval_") and eval_data is None:
                raise UsageError(f"early_stopping monitors {early_stopping.monitor!r}, which needs eval_data; pass "
                                 "fit(..., eval_data=...) or EarlyStopping(monitor='loss')")
        if not isinstance(train_data, Iterable) or isinstance(train_data, (str, bytes)):
            raise UsageError(f"train_data={train_data!r} is not an iterable of batches; pass a DataLoader, an "
                             "ImageLoader or a list of (inputs, targets), e.g. fit(loader, epochs=3)")
        if epochs > 1 and isinstance(train_data, Iterator):  # its second epoch would find it used up
            raise UsageError(f"train_data is a one-shot iterator ({type(train_data).__name__}), which epochs={epochs} "
                             "would find empty after the first epoch; pass a list, a DataLoader or an ImageLoader "
                             "(re-iterable), or call fit(..., epochs=1) once per fresh iterator")
        result = FitResult()
        self.should_stop = False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        total = _len_or_none(train_data)
        resumable = _resumable_sampler(train_data)  # advanced after each batch: a mid-epoch save resumes after it
        # Data that records its own position (ImageLoader, StatefulDataLoader: a state_dict) is read without a batch of
        # look-ahead, or its state_dict taken between steps counted one batch more than was trained and a resume from
        # it skipped that batch; the epoch's partial accumulation is stepped after the loop instead of with its last
        # batch. Other data is read a batch ahead to flag its last one (it needs no len).
        late = _records_position(train_data) and self._can_close_late()
        walk = (lambda d: ((b, False) for b in d)) if late else _mark_last
        with _progress(self.progress, description) as bar:
            task = bar.add_task(description, total=(total * epochs) if total else None, loss=float("nan"), tput=0.0) if bar else None
            for i in range(epochs):
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
                for batch, end in walk(train_data):
                    losses.append(self.train_step(batch, end_of_epoch=end))
                    if resumable is not None:
                        resumable.advance()
                    sizes.append(_rows(*_split(batch, self._loss_fn_given)))
                    samples += sizes[-1]
                    if bar is not None and time.perf_counter() - shown >= BAR_SECONDS:
                        # reading the loss waits for the device: at most once per BAR_SECONDS, not every few steps
                        shown = time.perf_counter()
                        bar.update(task, advance=len(losses) - on_bar, loss=float(losses[-1]), tput=samples / (shown - t0))
                        on_bar = len(losses)
                if late:
                    self._close_accumulation()
                synchronize(self.device)
                seconds = time.perf_counter() - t0
                if not losses and not self._trained_to_epoch_end(train_data, resumable, total):
                    if resumable is not None and len(resumable) == 0:
                        raise UsageError(
                            f"the training data's ResumableSampler has no sample left in epoch {self.epoch} (its "
                            f"state_dict: {resumable.state_dict()}): it was used up, by an earlier fit at this epoch "
                            "or a checkpoint saved at the epoch's end, while this trainer has trained nothing; give "
                            "it a fresh sampler, or load the checkpoint saved with the sampler's state")
                    raise UsageError("the training data yielded no batch; check the dataset and batch size (or, for "
                                     "an iterator or generator, that an earlier fit did not use it up; for data "
                                     "resumed from a state_dict saved at an epoch's end, load the trainer's "
                                     "checkpoint saved with it)")
                if not losses and not late and self._can_close_late():
                    self._close_accumulation()  # a hand-written loop's save after the epoch's last micro-batch
                # (n,): the steps with an inf/NaN loss were not applied (amp's guard skipped them), so
                # the mean is over the finite ones
                stacked = torch.stack(losses).float() if losses else torch.zeros(0)
                finite = torch.isfinite(stacked)
                weights = torch.tensor(sizes, dtype=torch.float32, device=stacked.device)[finite]
                if bool(finite.any()) and not bool(weights.any()):  # no batch size readable: each step weighs alike
                    weights = torch.ones_like(weights)  # (a weight sum of 0 made the mean NaN: "training diverged")
                mean_loss = (float((stacked[finite] * weights).sum() / weights.sum()) if bool(finite.any())
                             else math.nan)
                # an epoch whose batches were all trained before a resume reports no loss (NaN) and finishes as the
                # uninterrupted run's did: the pending accumulation stepped, evaluation, schedulers, epoch + 1
                if losses and not math.isfinite(mean_loss):
                    raise OverdriveError(
                        f"training diverged: no finite loss in epoch {self.epoch}; lower the learning rate, check the "
                        "data, or use a dynamic loss scale"
                    )
                stats = EpochStats(self.epoch, mean_loss, samples, seconds, self.skipped_steps - skipped0)
                if eval_data is not None:
                    if self.parallel is not None:  # FSDP2: uneven counts are an error here, not a hang in an all-gather
                        self.parallel.check_same_batches(_len_or_none(eval_data), stats.epoch, what="evaluation")
                    # under DDP / FSDP each rank evaluates its shard; the sums go over the ranks, so every rank
                    # reports the mean over all samples (a mean of the ranks' means weighted a short shard too much)
                    stats.eval_loss, stats.eval_accuracy = evaluate(
                        self.model, eval_data, self.mp, self.channels_last,
                        loss_fn=self.loss_fn if self._loss_fn_given else None,
                        over_ranks=self.parallel is not None,
                    )
                if self._plateau and (losses or stats.eval_loss is not None):  # no metric: nothing to judge
                    if stats.eval_loss is not None:  # already the same on every rank
                        metric = stats.eval_loss
                    else:
                        # each rank's loss is its own shard's: stepped on it, ranks lowered their lr at different
                        # epochs and the DDP / FSDP replicas drifted apart; the mean over ranks gives every rank one lr
                        metric = _mean_over_ranks(mean_loss, self.device) if self.parallel is not None else mean_loss
                    self.scheduler.step(metric)
                elif self.scheduler is not None and self.scheduler_interval == "epoch":
                    self.scheduler.step()  # after the epoch's eval, as a hand-written torch loop steps an epoch scheduler
                if bar is not None:
                    bar.update(task, completed=(i + 1) * total if total else None, loss=mean_loss, tput=stats.samples_per_s)
                result.history.append(stats)
                self.epoch += 1
                judged = losses or early_stopping is None or early_stopping.monitor.startswith("eval_")
                if early_stopping is not None and judged and self._early_stop(early_stopping, stats):
                    self.should_stop = True
                if on_epoch_end is not None and on_epoch_end(stats) is True:
                    self.should_stop = True
                if self.parallel is not None:
                    # any rank's stop stops all: a rank leaving alone hung the others in their next collective
                    self.should_stop = _mean_over_ranks(float(self.should_stop), self.device) > 0
                if self.should_stop:
                    result.stopped_epoch = stats.epoch
                    break
        result.peak_memory_mib = memory_mib(self)
        return result

    def _trained_to_epoch_end(self, data: Any, resumable: Any, total: int | None) -> bool:
        """Whether a pass that yielded no batch means that this epoch's batches were all trained before: the data
        resumed itself at the epoch's end (a checkpoint saved after its last batch, before fit closed the epoch) and
        this trainer has trained (``micro_step`` > 0: a fresh trainer over used-up data is an error, not an epoch).
        Such data has batches in an epoch: a ResumableSampler with steps per epoch, or data recording its position
        (ImageLoader, StatefulDataLoader) whose ``len`` counts the whole epoch's."""
        if self._micro == 0:
            return False
        if resumable is not None:
            return len(resumable) == 0 and resumable.steps_per_epoch() > 0
        return _records_position(data) and bool(total)

    def _early_stop(self, es: EarlyStopping, stats: EpochStats) -> bool:
        value = getattr(stats, es.monitor)
        if value is None:  # eval_accuracy of a model that does not classify
            raise UsageError(f"early_stopping monitors {es.monitor!r}, which this model's evaluation leaves None (not "
                             "(N, C) scores against class indices); monitor 'eval_loss' instead")
        if self.parallel is not None and not es.monitor.startswith("eval_"):
            # each rank's training loss is its own shard's: the mean over ranks gives every rank the same decision
            # (the eval metrics are already over every rank's samples)
            value = _mean_over_ranks(value, self.device)
        return es.step(value, stats.epoch)

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
