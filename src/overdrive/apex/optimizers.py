"""apex.optimizers over torch.optim: ``FusedAdam``, ``FusedSGD`` and ``FusedLAMB`` with apex's arguments.

``FusedAdam`` is torch's AdamW (apex's default ``adam_w_mode=True``) or Adam, ``FusedSGD`` torch's SGD, each
with ``fused=True`` when every parameter is on a device torch has a fused kernel for, else ``foreach=True``.
torch has no LAMB, so ``FusedLAMB`` is :class:`Lamb`, apex's FusedLAMB algorithm written with torch's
``_foreach`` ops. Arguments apex had and torch lacks are refused with what to do instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from overdrive._utils.errors import UsageError

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


class Lamb(torch.optim.Optimizer):
    """apex's FusedLAMB in torch: Adam moments, then each tensor's step scaled by its trust ratio
    ``||w|| / ||update||``, after clipping the global gradient norm to ``max_grad_norm``.

    Per tensor: ``m = b1*m + (1-b1)*g`` (``g`` without the ``1-b1`` when ``grad_averaging=False``),
    ``v = b2*v + (1-b2)*g*g``, ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay*w`` (``adam_w_mode``; else the
    decay is added to ``g`` first), ``w -= lr * r * u`` with ``r = ||w|| / ||u||`` when both are nonzero
    and the group has weight decay (or ``use_nvlamb``), else 1. As apex's kernel does.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4)); opt = Lamb([w], lr=0.1)
        >>> w.grad = torch.ones(4); opt.step(); round(float(w.detach()[0]), 4)
        0.9
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False) -> None:
        _refuse("FusedLAMB", amsgrad=(amsgrad, amsgrad, "apex's FusedLAMB refused it too"))
        if not lr >= 0 or not eps >= 0 or not all(0 <= b < 1 for b in betas):
            raise UsageError(f"FusedLAMB(lr={lr}, betas={betas}, eps={eps}): lr and eps >= 0, betas in [0, 1)")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": grad_averaging, "max_grad_norm": max_grad_norm}
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [q.grad for g in self.param_groups for q in g["params"] if q.grad is not None]
        if not grads:
            return loss
        # one global norm over every gradient (apex: before the moments), in fp32
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.float()) for x in grads]))
        for group in self.param_groups:
            params = [q for q in group["params"] if q.grad is not None]
            if not params:
                continue
            b1, b2 = group["betas"]
            max_norm = group["max_grad_norm"]
            clip = torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm)) if max_norm > 0 else None
            for q in params:
                state = self.state[q]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(q, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(q, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                g = q.grad.float()
                if clip is not None:
                    g = g / clip.to(g.device)
                w = q.float()
                if not self.adam_w_mode and group["weight_decay"]:
                    g = g + group["weight_decay"] * w
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=(1 - b1) if group["grad_averaging"] else 1.0)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1 = 1 - b1**t if group["bias_correction"] else 1.0
                c2 = 1 - b2**t if group["bias_correction"] else 1.0
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if self.adam_w_mode and group["weight_decay"]:
                    update = update + group["weight_decay"] * w
                ratio = 1.0
                if self.use_nvlamb or group["weight_decay"]:
                    w_norm, u_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(update)
                    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                q.copy_(w - group["lr"] * ratio * update)
        return loss


FusedLAMB = Lamb

__all__ = ["FusedAdam", "FusedSGD", "FusedLAMB", "Lamb"]
