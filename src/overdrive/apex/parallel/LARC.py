"""apex.parallel.LARC: layer-wise adaptive rate control around any optimizer (You et al., arXiv:1708.03888).

The module keeps apex's name so that both ``from apex.parallel import LARC`` and ``from apex.parallel.LARC import
LARC`` port by changing ``apex`` to ``overdrive.apex``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overdrive._utils.errors import UsageError


class LARC(torch.optim.Optimizer):
    """apex.parallel.LARC: scale each parameter's gradient by its local learning rate, then step ``optimizer``.

    Per parameter ``p`` of a group with learning rate ``lr`` and weight decay ``wd``, as apex does::

        local = trust_coefficient * ||p|| / (||grad|| + wd * ||p|| + eps)
        local = min(local / lr, 1)           # clip=True: the step's rate is min(lr, local)
        grad  = (grad + wd * p) * local      # only where ||p|| and ||grad|| are both nonzero

    The group's ``weight_decay`` is set to 0 for the wrapped optimizer's step (LARC applied it) and put back
    after. ``param_groups``, ``state``, ``state_dict``, ``load_state_dict``, ``zero_grad`` and ``add_param_group``
    are the wrapped optimizer's. LARC is a ``torch.optim.Optimizer`` itself (apex's was a plain object), so
    ``amp.initialize``, step hooks and torch's learning-rate schedulers take it. The norms stay on the device:
    no host sync per parameter.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> opt = LARC(torch.optim.SGD([w], lr=0.1), trust_coefficient=0.02, clip=False)
        >>> w.grad = torch.full((4,), 0.5); opt.step()
        >>> round(float(w.detach()[0]), 6)  # local rate 0.02 * 2 / 1 = 0.04: w -= 0.1 * 0.04 * 0.5
        0.998
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"LARC(optimizer={type(optimizer).__name__}) wraps a torch.optim.Optimizer: build one "
                             "(torch.optim.SGD(model.parameters(), ...)) and pass it")
        if not trust_coefficient > 0 or not eps >= 0:
            raise UsageError(f"LARC(trust_coefficient={trust_coefficient}, eps={eps}): trust_coefficient > 0 and "
                             "eps >= 0 (apex's examples use 0.001 to 0.02, and 1e-8)")
        # Optimizer.__init__ would build param groups of its own; the wrapped optimizer's are used instead, so
        # only the per-instance hook tables are set up, by torch's own unpickling path.
        torch.optim.Optimizer.__setstate__(self, {
            "optim": optimizer, "trust_coefficient": trust_coefficient, "clip": clip, "eps": eps,
            "defaults": dict(optimizer.defaults)})

    # --- the wrapped optimizer's surface ---------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (apex's LARC added nothing of its own)."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        """The wrapper's settings and the wrapped optimizer, so that pickle and ``copy.deepcopy`` round trip
        (apex returned the wrapped optimizer's own state here, which could not be unpickled into a LARC)."""
        return {"optim": self.optim, "trust_coefficient": self.trust_coefficient, "clip": self.clip,
                "eps": self.eps, "defaults": self.defaults}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A state from :meth:`__getstate__`; or, as apex forwarded it, a state for the wrapped optimizer."""
        if "optim" in state:
            torch.optim.Optimizer.__setstate__(self, state)
        else:
            self.optim.__setstate__(state)

    def __repr__(self) -> str:
        return (f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps}) over "
                f"{self.optim!r}")

    # --- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def _scale_grads(self, group: dict[str, Any], weight_decay: float) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        w_norms = torch._foreach_norm(params)  # one 0-dim tensor per parameter, on its device
        g_norms = torch._foreach_norm(grads)
        for p, g, wn, gn in zip(params, grads, w_norms, g_norms):
            wn, gn = wn.float(), gn.float()
            local = self.trust_coefficient * wn / (gn + wn * weight_decay + self.eps)
            if self.clip:
                local = torch.clamp(local / group["lr"], max=1.0)
            ok = (wn != 0) & (gn != 0)
            if weight_decay:
                g.add_(p * torch.where(ok, weight_decay, 0.0).to(p.dtype))
            g.mul_(torch.where(ok, local, 1.0).to(g.dtype))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Scale the gradients (see the class docstring), then step the wrapped optimizer with the groups'
        weight decay at 0. ``closure`` (not in apex) is evaluated first, with gradients on."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decays = []
        for group in self.optim.param_groups:
            wd = group.get("weight_decay", 0.0)
            decays.append(wd)
            self._scale_grads(group, float(wd))
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        try:
            self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, decays):
                if "weight_decay" in group:
                    group["weight_decay"] = wd
        return loss


__all__ = ["LARC"]
