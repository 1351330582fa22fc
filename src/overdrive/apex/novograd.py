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


def _apex_norm_lists(params: list[torch.Tensor], has_state: list[bool], norms: list[torch.Tensor | None]
                     ) -> list[torch.Tensor]:
    """apex's ``group["exp_avg_sq"]``: ``[fp16 norms, fp32 norms]``, each a 1-D fp32 tensor in the order of the
    group's parameters that have state (those stepped), as apex's kernel reads them."""
    out = []
    for dtype in (torch.float16, torch.float32):
        vals = [n.reshape(()).float().cpu() for q, s, n in zip(params, has_state, norms)
                if s and n is not None and q.dtype == dtype]
        out.append(torch.stack(vals) if vals else torch.zeros(0))
    return out


class NovoGrad(torch.optim.Optimizer):
    """apex.optimizers.FusedNovoGrad (see the module docstring). The math is fp32; the first moment is kept in
    the parameter's dtype and each tensor's gradient norm ``v`` in fp32, both in the parameter's state
    (``exp_avg``, ``exp_avg_sq``).

    Checkpoints go both ways: apex kept the norms as two lists in the param group (``exp_avg_sq``: fp16
    parameters' norms, fp32 parameters' norms, in parameter order), and :meth:`load_state_dict` takes that
    layout; :meth:`state_dict` writes those lists too, so apex's FusedNovoGrad can load it.

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

    def state_dict(self) -> dict[str, Any]:
        """torch's, with apex's per-group ``exp_avg_sq`` lists added (see the class docstring).

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2)); opt = NovoGrad([w]); w.grad = torch.ones(2); opt.step()
            >>> opt.state_dict()["param_groups"][0]["exp_avg_sq"]  # [fp16 norms, fp32 norms]
            [tensor([]), tensor([1.4142])]
        """
        sd = super().state_dict()
        for packed, group in zip(sd["param_groups"], self.param_groups):
            params = group["params"]
            states = [self.state.get(q, {}) for q in params]
            packed["exp_avg_sq"] = _apex_norm_lists(params, [bool(st) for st in states],
                                                    [st.get("exp_avg_sq") for st in states])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, also taking apex's layout (the norms in each param group's ``exp_avg_sq`` lists), and keeping
        the norms fp32 (torch would cast them to a half parameter's dtype, where they overflow past 65504).

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2)); opt = NovoGrad([w])
            >>> apex_sd = {"state": {0: {"exp_avg": torch.zeros(2)}},
            ...            "param_groups": [dict(opt.state_dict()["param_groups"][0], step=3,
            ...                                  exp_avg_sq=[torch.zeros(0), torch.tensor([0.5])])]}
            >>> opt.load_state_dict(apex_sd); float(opt.state[w]["exp_avg_sq"]), opt.param_groups[0]["step"]
            (0.5, 3)
        """
        saved_state = dict(state_dict.get("state", {}))
        groups = []
        for saved, group in zip(state_dict.get("param_groups", []), self.param_groups):
            saved = dict(saved)
            lists = saved.pop("exp_avg_sq", None)
            ids = saved.get("params", [])
            stepped = [(i, q) for i, q in zip(ids, group["params"]) if saved_state.get(i)]
            if lists is not None and any("exp_avg_sq" not in saved_state[i] for i, _ in stepped):
                self._spread_apex_norms(lists, stepped, saved_state)
            groups.append(saved)
        groups += [dict(g) for g in state_dict.get("param_groups", [])[len(groups):]]
        super().load_state_dict(dict(state_dict, state=saved_state, param_groups=groups))
        ids = [i for g in groups for i in g.get("params", [])]
        for i, q in zip(ids, (q for g in self.param_groups for q in g["params"])):
            norm = saved_state.get(i, {}).get("exp_avg_sq")
            if isinstance(norm, torch.Tensor) and q in self.state:
                self.state[q]["exp_avg_sq"] = norm.detach().reshape(()).to(q.device, torch.float32, copy=True)

    @staticmethod
    def _spread_apex_norms(lists: Any, stepped: list[tuple[Any, torch.Tensor]], saved_state: dict[Any, Any]) -> None:
        """Move apex's ``[fp16 norms, fp32 norms]`` of one group into ``saved_state``, one 0-d norm per parameter."""
        if not isinstance(lists, (list, tuple)) or len(lists) != 2:
            raise UsageError(f"FusedNovoGrad.load_state_dict: a param group's 'exp_avg_sq' is {type(lists).__name__}; "
                             "apex's layout is [fp16 norms, fp32 norms]; pass a state dict saved by FusedNovoGrad")
        for dtype, norms in zip((torch.float16, torch.float32), lists):
            mine = [i for i, q in stepped if q.dtype == dtype]
            flat = torch.zeros(0) if norms is None else torch.as_tensor(norms).reshape(-1)
            if flat.numel() != len(mine):
                raise UsageError(f"FusedNovoGrad.load_state_dict: the checkpoint has {flat.numel()} {dtype} gradient "
                                 f"norms in a param group whose stepped {dtype} parameters number {len(mine)}; load "
                                 "it into an optimizer over the same parameters, in the same order and dtypes")
            for i, n in zip(mine, flat):
                saved_state[i] = dict(saved_state[i], exp_avg_sq=n.float().clone())

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
