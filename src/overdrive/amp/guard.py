"""What an optimizer step with inf/NaN gradients (or an inf/NaN loss) does: skip it and count it, or stop.

Every opt level and loss scale checks before the optimizer steps, with torch's fused
``_amp_foreach_non_finite_check_and_unscale_`` (one kernel per device and dtype, whatever the number of
parameters) and one host sync per step. A dynamic scale already checks each backward, so its steps are
not checked again. Without this, a bf16 run (static scale 1) applied an inf gradient: the weights became
NaN and the loss stayed NaN for the rest of the epoch, with no word.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from overdrive._utils.errors import OverdriveError

ON_NONFINITE = ("skip", "raise")
FIX = ("lower the learning rate, check the data and the loss for inf/NaN (torch.autograd.set_detect_anomaly(True) "
       "names the op), clip the gradients (grad_clip=, clip_grad_norm_), or with fp16 use loss_scale='dynamic'")


def found_nonfinite(tensors: Sequence[torch.Tensor], inv_scale: float = 1.0) -> torch.Tensor | None:
    """Multiply ``tensors`` by ``inv_scale`` in place and flag any inf/NaN, without a host sync.

    One fused kernel per (device, dtype); ``inv_scale=1.0`` only checks. Returns a (1,) float32 tensor on the
    first tensor's device, > 0 when some element is not finite, or None when there is nothing to check.
    Sharded (DTensor, FSDP2) gradients are checked on this rank's shard, and the flag is then summed over the ranks
    (every rank calls this at the same point of a step), so every rank makes the same skip decision: checked per
    shard, a rank whose shard held the inf skipped while the others stepped, and the model came out half updated.

    Example:
        >>> found_nonfinite([torch.ones(3), torch.tensor([1.0, float("nan")])]).item()
        1.0
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    sharded = False
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank checks its shard, as a plain tensor
            t = t.to_local()
            sharded = True
        t = t._values() if t.is_sparse else t  # the stored values are what can be inf
        if t.is_complex():  # (spectral layers' complex weights) the fused kernel takes real dtypes: check and unscale
            t = torch.view_as_real(t)  # the real and imaginary parts in place, through a real view
        groups.setdefault((t.device, t.dtype), []).append(t)
    found = None
    for (device, dtype), group in groups.items():
        if device.type == "cuda" and dtype not in (torch.float32, torch.float16):
            # the fused kernel has no bf16 CUDA variant (O3 bf16 weights have bf16 gradients): the inf-norm of
            # each tensor is inf or NaN exactly when one of its elements is, in one foreach kernel as well
            if inv_scale != 1.0:
                torch._foreach_mul_(group, inv_scale)
            norms = torch.stack(torch._foreach_norm(group, float("inf")))
            flag = (~torch.isfinite(norms)).any().float().reshape(1)
        else:
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), inv_scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        found = flag if found is None else found + flag.to(found.device)
    if sharded and found is not None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found)  # on the device: no host sync of its own
    return found


class StepGuard:
    """Counts optimizer steps and skipped ones; warns, or raises, as ``on_nonfinite`` says.

    A skip with a reason (``why``: the gradients or the loss hold inf/NaN where no loss scale explains it)
    warns once per run of skipped steps with ``on_nonfinite="skip"``, and raises at once with ``"raise"``. A
    skip without one (a dynamic scale backing off, which is routine) is only counted. ``max_consecutive``
    skipped steps in a row, of either kind, end the run with an error: the weights have stopped changing.
    Steps are numbered per optimizer from 0, or from what :meth:`number` sets (a training loop's count).

    Example:
        >>> g = StepGuard(max_consecutive=2)
        >>> g.step_taken(0); g.step_skipped(0, None); g.skipped, g.steps[0]
        (1, 2)
        >>> g.step_skipped(0, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.OverdriveError: training diverged: 2 optimizer steps in a row (steps 1 to 2) ...
    """

    def __init__(self, on_nonfinite: str = "skip", max_consecutive: int | None = None, n_optimizers: int = 1) -> None:
        self.on_nonfinite = on_nonfinite
        self.max_consecutive = max_consecutive
        self.n_optimizers = n_optimizers
        self.skipped = 0  # optimizer steps skipped, all optimizers together
        self.steps: dict[int, int] = {}  # optimizer index -> steps so far (skipped ones included)
        self._run: dict[int, int] = {}  # optimizer index -> skipped steps in a row
        self._warned: set[int] = set()  # optimizers warned about in their current run of skips

    def number(self, index: int, step: int) -> None:
        """Name the next step of optimizer ``index`` ``step`` in messages (a loop's own step count)."""
        self.steps[index] = int(step)

    def step_taken(self, index: int) -> None:
        self.steps[index] = self.steps.get(index, 0) + 1
        self._run[index] = 0
        self._warned.discard(index)

    def step_skipped(self, index: int, why: str | None) -> None:
        """Count a skipped step of optimizer ``index``; ``why`` says what no loss scale explains, or is None."""
        step = self.steps.get(index, 0)
        where = f"optimizer {index} step {step}" if self.n_optimizers > 1 else f"step {step}"
        if why is not None and self.on_nonfinite == "raise":
            raise OverdriveError(
                f"{where}: {why}; the step was not applied, and on_nonfinite='raise' stops the run here. To fix: "
                f"{FIX}; on_nonfinite='skip' skips such steps and counts them instead"
            )
        self.skipped += 1
        self.steps[index] = step + 1
        run = self._run[index] = self._run.get(index, 0) + 1
        if why is not None and index not in self._warned:
            self._warned.add(index)
            limit = (f"; {self.max_consecutive} skipped steps in a row stop the run" if self.max_consecutive else "")
            warnings.warn(
                f"{where}: {why}; the optimizer step was skipped (the weights are unchanged) and counted "
                f"({self.skipped} skipped so far){limit}. To fix: {FIX}", RuntimeWarning, stacklevel=4)
        if self.max_consecutive is not None and run >= self.max_consecutive:
            raise OverdriveError(
                f"training diverged: {run} optimizer steps in a row (steps {step + 1 - run} to {step}"
                f"{f' of optimizer {index}' if self.n_optimizers > 1 else ''}) were skipped for inf/NaN gradients "
                f"or loss, so the weights have not changed since. To fix: {FIX}; the policy's "
                "max_consecutive_skips=None lets the run go on"
            )


def read_flags(*flags: torch.Tensor | None) -> list[bool]:
    """Whether each flag (> 0, or True) is set, read in one host sync; None reads as False, with no sync
    when all are None. Flags on the 'meta' device (no data: shape-only runs) read as False too.

    Example:
        >>> read_flags(torch.ones(1), None, torch.tensor(False))
        [True, False, False]
    """
    flags = tuple(None if f is None or f.device.type == "meta" else f for f in flags)
    present = [f for f in flags if f is not None]
    if not present:
        return [False] * len(flags)
    device = present[0].device
    values = iter(torch.cat([f.reshape(1).float().to(device) for f in present]).tolist())
    return [f is not None and next(values) > 0 for f in flags]
