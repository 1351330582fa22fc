"""What :class:`~overdrive.train.Trainer` does, as one frozen config: the amp policy, gradient clipping and
accumulation, compile / channels-last, the progress bar, the device and the distributed strategy.

The objects a trainer works on (model, optimizer, loss function, scheduler) are not config: they stay
arguments of ``Trainer``. Every setting can also be given to ``Trainer`` as a keyword, which replaces that field.

Example:
    >>> cfg = TrainConfig(policy="O2", accumulate=4, grad_clip=1.0)
    >>> TrainConfig.from_json(cfg.to_json()) == cfg
    True
    >>> cfg.replace(accumulate=0)
    Traceback (most recent call last):
    ...
    overdrive._utils.errors.UsageError: accumulate=0 must be an int >= 1 (micro-batches per optimizer step)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from overdrive._utils.config import ConfigBase
from overdrive._utils.errors import UsageError
from overdrive.amp.config import Policy


@dataclass(frozen=True)
class TrainConfig(ConfigBase):
    """The plain-value settings of a :class:`~overdrive.train.Trainer`.

    - ``policy``: an :class:`overdrive.amp.Policy` or an opt-level string ("O0".."O3"), kept as given; in
      JSON a Policy is its dict, a string stays a string.
    - ``device``: where the model and batches go ("cuda", "cuda:1", "cpu"); None: the model's device.
      A ``torch.device`` is stored as its string.
    - ``grad_clip``: max global gradient norm, or None for no clipping.
    - ``accumulate``: micro-batches per optimizer step.
    - ``compile``: torch.compile the model's forward (the step stays eager).
    - ``progress``: a rich progress bar in :meth:`Trainer.fit`.
    - ``channels_last``: 4-D batches are made channels-last.
    - ``strategy``: None (one process), "ddp" / "fsdp" / "none", or an ``overdrive.distributed.Strategy``;
      in JSON a Strategy is its dict.

    Example:
        >>> from overdrive.amp import Policy
        >>> cfg = TrainConfig(policy=Policy(opt_level="O1", dtype=torch.bfloat16), progress=False)
        >>> cfg.to_dict()["policy"]["opt_level"], TrainConfig.from_dict(cfg.to_dict()).policy == cfg.policy
        ('O1', True)
    """

    policy: Policy | str = "O0"
    device: str | None = None
    grad_clip: float | None = None
    accumulate: int = 1
    compile: bool = False
    progress: bool = True
    channels_last: bool = False
    # str | overdrive.distributed.Strategy | None. Typed Any (decoded by _decode_field) so that importing
    # overdrive.train does not import overdrive.distributed, and with it torch.distributed (~0.6 s).
    strategy: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            Policy(opt_level=self.policy)  # names the opt levels if the string is not one of them
        elif not isinstance(self.policy, Policy):
            raise UsageError(f"policy={self.policy!r} must be an opt level ('O0', 'O1', 'O2', 'O3') or an "
                             "overdrive.amp.Policy")
        if self.device is not None:  # stored as torch's name of it ('cuda:1'): JSON-safe and hashable
            try:
                object.__setattr__(self, "device", str(torch.device(self.device)))
            except (RuntimeError, TypeError) as exc:
                raise UsageError(f"device={self.device!r} is not a torch device; use e.g. 'cuda', 'cuda:1' or "
                                 "'cpu'") from exc
        if self.grad_clip is not None:
            if isinstance(self.grad_clip, bool) or not isinstance(self.grad_clip, (int, float)) \
                    or not math.isfinite(self.grad_clip) or self.grad_clip <= 0:
                raise UsageError(f"grad_clip={self.grad_clip!r} must be a positive finite max norm (e.g. 1.0) or "
                                 "None for no clipping")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise UsageError(f"accumulate={self.accumulate!r} must be an int >= 1 (micro-batches per optimizer step)")
        for flag in ("compile", "progress", "channels_last"):
            if not isinstance(getattr(self, flag), bool):
                raise UsageError(f"{flag}={getattr(self, flag)!r} must be True or False")
        if self.strategy is not None:
            from overdrive.distributed.config import Strategy

            if isinstance(self.strategy, str):
                Strategy.from_name(self.strategy)  # names the known strategies if it is not one
            elif not isinstance(self.strategy, Strategy):
                raise UsageError(f"strategy={self.strategy!r} must be 'ddp', 'fsdp', 'none', an "
                                 "overdrive.distributed.Strategy, or None")

    @classmethod
    def _decode_field(cls, name: str, value: Any, hint: Any) -> Any:
        # to_dict wrote a Policy / Strategy as its dict (the base encodes any config so); a string stays a string
        if name == "policy" and isinstance(value, Mapping):
            return Policy.from_dict(value)
        if name == "strategy" and isinstance(value, Mapping):
            from overdrive.distributed.config import Strategy

            return Strategy.from_dict(value)
        return super()._decode_field(name, value, hint)
