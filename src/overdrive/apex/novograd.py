"""apex.optimizers.FusedNovoGrad in torch: NovoGrad (Ginsburg et al., arXiv:1905.11286), the optimizer of
NVIDIA's Jasper and QuartzNet, with apex's arguments and its kernel's arithmetic.

Per parameter, with ``n`` the norm of its gradient (``norm_type=2``: L2; ``0``: the largest magnitude)::

    v = sqrt(b2 * v**2 + (1 - b2) * n**2)     # norm_type=2;  norm_type=0: v = b2 * v + (1 - b2) * n
    c1, c2 = 1 - b1**t, sqrt(1 - b2**t)       # both 1 with bias_correction=False
    b3 = 1 - b1 if grad_averaging else 1
    reg_inside_moment=False (apex's default): m = b1*m + b3*g;  w -= lr * ((m/c1) / (v/c2 + eps) + wd*w)
    reg_inside_moment=True:   m = b1*m + b3*(g / (v/c2 + eps) + wd*w);  w -= lr * m/c1

``v`` starts at 0 with ``init_zero=True``, else at the first step's ``n`` (so that step's blend leaves it there).
``t`` is the group's ``step``, advanced at every ``step()`` as apex does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from overdrive._utils.errors import UsageError


class NovoGrad(torch.optim.Optimizer):
    """apex.optimizers.FusedNovoGrad (see the module docstring). The math is fp32; the first moment is kept in
    the parameter's dtype and each tensor's gradient norm ``v`` in fp32, both in the parameter's state
    (``exp_avg``, ``exp_avg_sq``; apex kept the norms as two lists in the param group).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4)); opt = NovoGrad([w], lr=0.1)
        >>> w.grad = torch.full((4,), 2.0); opt.step()
        >>> round(float(w.detach()[0]), 4)  # m/c1 = 2, v/c2 = 4 / sqrt(0.001): w -= 0.1 * 2 * sqrt(0.001) / 4
        0.9984
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise UsageError("FusedNovoGrad(amsgrad=True) is not supported: apex's FusedNovoGrad refused it too")
        if norm_type not in (0, 2):
            raise UsageError(f"FusedNovoGrad(norm_type={norm_type!r}): 2 (L2) or 0 (infinity norm), as in apex")
        if not lr >= 0 or not eps >= 0 or not all(0 <= b < 1 for b in betas):
            raise UsageError(f"FusedNovoGrad(lr={lr}, betas={betas}, eps={eps}): lr and eps >= 0, betas in [0, 1)")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": grad_averaging, "norm_type": norm_type,
                    "init_zero": init_zero}
        super().__init__(params, defaults)
        # apex's moment_mode: 0 puts the decay (and the normalization) inside the moment
        self.moment_mode = 0 if reg_inside_moment else 1

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            group["step"] = t = group.get("step", 0) + 1
            c1 = 1 - b1**t if group["bias_correction"] else 1.0
            c2 = math.sqrt(1 - b2**t) if group["bias_correction"] else 1.0
            b3 = 1 - b1 if group["grad_averaging"] else 1.0
            lr, eps, wd, l2 = group["lr"], group["eps"], group["weight_decay"], group["norm_type"] == 2
            for q in group["params"]:
                if q.grad is None:
                    continue
                if q.grad.is_sparse:
                    raise UsageError("FusedNovoGrad does not take sparse gradients (apex's did not either); use "
                                     "torch.optim.SparseAdam for sparse embeddings")
                g, w = q.grad.float(), q.float()
                n = torch.linalg.vector_norm(g, ord=2 if l2 else math.inf)
                state = self.state[q]
                if not state:
                    state["exp_avg"] = torch.zeros_like(q)
                    state["exp_avg_sq"] = torch.zeros_like(n) if group["init_zero"] else n.clone()
                v = state["exp_avg_sq"]
                v.copy_(torch.sqrt(b2 * v * v + (1 - b2) * n * n) if l2 else b2 * v + (1 - b2) * n)
                denom = v / c2 + eps
                m = state["exp_avg"].float()
                if self.moment_mode == 0:
                    m.mul_(b1).add_(g / denom + wd * w, alpha=b3)
                    w = w - lr * (m / c1)
                else:
                    m.mul_(b1).add_(g, alpha=b3)
                    w = w - lr * ((m / c1) / denom + wd * w)
                if state["exp_avg"] is not m:
                    state["exp_avg"].copy_(m)
                q.copy_(w)
        return loss


__all__ = ["NovoGrad"]
