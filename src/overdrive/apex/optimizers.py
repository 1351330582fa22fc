"""apex.optimizers over torch.optim, with apex's arguments.

``FusedAdam`` is torch's AdamW (apex's default ``adam_w_mode=True``) or Adam, ``FusedSGD`` torch's SGD, each
with ``fused=True`` when every parameter is on a device torch has a fused kernel for, else ``foreach=True``;
``FusedAdagrad`` is torch's Adagrad with apex's decoupled ``adagrad_w_mode``. torch has no LAMB or NovoGrad, so
``FusedLAMB`` / ``FusedMixedPrecisionLamb`` (:mod:`overdrive.apex.lamb`) and ``FusedNovoGrad``
(:mod:`overdrive.apex.novograd`) are apex's algorithms written in torch, checked against float64 references.
Arguments apex had and torch lacks are refused with what to do instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive.apex.lamb import Lamb, MixedPrecisionLamb
from overdrive.apex.novograd import NovoGrad

_FUSED_DEVICES = ("cuda", "cpu", "mps", "xpu")


def _fast_path(params: list[Any]) -> dict[str, bool]:
    tensors = [q for g in params for q in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(isinstance(q, torch.Tensor) and q.device.type in _FUSED_DEVICES
                                  and q.is_floating_point() for q in tensors)
    return {"fused": True} if fused else {"foreach": True}


def _refuse(name: str, **bad: tuple[Any, bool, str]) -> None:
    """``key=(value given, is it unsupported, why)``: raise for the first unsupported one."""
    for key, (value, unsupported, why) in bad.items():
        if unsupported:
            raise UsageError(f"{name}({key}={value!r}) is not supported: {why}")


def FusedAdam(  # noqa: N802 - apex's class name; returns a torch optimizer
    params: Iterable[Any],
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    adam_w_mode: bool = True,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    set_grad_none: bool = True,
    capturable: bool = False,
    master_weights: bool = False,
) -> torch.optim.Optimizer:
    """apex.optimizers.FusedAdam: ``torch.optim.AdamW`` (``adam_w_mode=True``, apex's default) or ``Adam``.

    Example:
        >>> opt = FusedAdam(torch.nn.Linear(4, 2).parameters(), lr=1e-3, weight_decay=0.01)
        >>> type(opt).__name__, opt.defaults["fused"]
        ('AdamW', True)
    """
    _refuse("FusedAdam", bias_correction=(bias_correction, not bias_correction, "torch's Adam always corrects the bias"),
            master_weights=(master_weights, master_weights,
                            "use amp.initialize(..., opt_level='O2') for fp32 master weights"))
    params = list(params)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    # set_grad_none: torch's zero_grad sets grads to None by default already
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, capturable=capturable,
               **_fast_path(params))


def FusedSGD(  # noqa: N802
    params: Iterable[Any],
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    wd_after_momentum: bool = False,
    materialize_master_grads: bool = True,
    set_grad_none: bool = False,
) -> torch.optim.Optimizer:
    """apex.optimizers.FusedSGD: ``torch.optim.SGD``."""
    _refuse("FusedSGD", wd_after_momentum=(wd_after_momentum, wd_after_momentum,
                                           "torch's SGD adds weight decay before momentum"))
    params = list(params)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                           nesterov=nesterov, **_fast_path(params))


class FusedAdagrad(torch.optim.Adagrad):
    """apex.optimizers.FusedAdagrad: ``torch.optim.Adagrad`` (no lr decay, the sum starting at 0), with apex's
    ``adagrad_w_mode``: ``False`` adds ``weight_decay * w`` to the gradient (torch's L2), ``True`` decays the
    weight itself, ``w -= lr * (g / (sqrt(sum) + eps) + weight_decay * w)`` with the weight before the step.

    The state (``sum``, ``step``, torch's layout) is made at a parameter's first step, as apex did, not at
    construction as torch does: ``amp.initialize`` takes only optimizers that have not stepped.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = FusedAdagrad([w], lr=0.1, weight_decay=0.5,
        ...                                                           adagrad_w_mode=True)
        >>> w.grad = torch.ones(2); opt.step(); round(float(w.detach()[0]), 4)  # 1 - 0.1 * (1/1 + 0.5)
        0.85
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False) -> None:
        params = list(params)
        # torch has a fused Adagrad for CPU tensors only
        tensors = [q for g in params for q in (g["params"] if isinstance(g, dict) else [g])]
        fast = {"fused": True} if tensors and all(q.device.type == "cpu" for q in tensors) else {"foreach": True}
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, **fast)
        self.state.clear()  # torch's constructor made it; see _init_state
        self.adagrad_w_mode = adagrad_w_mode

    def _init_state(self) -> None:
        """torch's Adagrad state for the parameters about to get their first step."""
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for group in self.param_groups:
            for q in group["params"]:
                if q.grad is not None and not self.state[q]:
                    on = q.device if group["fused"] else torch.device("cpu")
                    self.state[q]["step"] = torch.zeros((), dtype=torch.float32 if group["fused"] else scalar,
                                                        device=on)
                    self.state[q]["sum"] = torch.zeros_like(q, memory_format=torch.preserve_format)

    def _torch_step(self) -> None:
        # torch wraps the step of each optimizer class it builds with the step hooks; once a plain Adagrad exists
        # its step is wrapped too, and calling it through super() would run this optimizer's hooks a second time
        step = torch.optim.Adagrad.step
        getattr(step, "__wrapped__", step)(self)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Make the state of parameters stepped for the first time, decay the weights (``adagrad_w_mode``),
        then torch's Adagrad step. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._init_state()
        if not self.adagrad_w_mode:
            self._torch_step()
            return loss
        decays = [g["weight_decay"] for g in self.param_groups]
        # torch's GradScaler sets found_inf on a fused optimizer: a skipped step must not decay the weights either
        found_inf = getattr(self, "found_inf", None)
        for group, wd in zip(self.param_groups, decays):
            params = [q for q in group["params"] if q.grad is not None]
            if wd and params:
                keep = 1 - group["lr"] * wd
                if found_inf is not None:
                    keep = torch.where(found_inf.reshape(()) > 0, 1.0, keep)
                torch._foreach_mul_(params, keep)
            group["weight_decay"] = 0.0
        try:
            self._torch_step()
        finally:
            for group, wd in zip(self.param_groups, decays):
                group["weight_decay"] = wd
        return loss


FusedLAMB = Lamb
FusedMixedPrecisionLamb = MixedPrecisionLamb
FusedNovoGrad = NovoGrad

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad", "FusedSGD", "Lamb",
           "MixedPrecisionLamb", "NovoGrad"]
