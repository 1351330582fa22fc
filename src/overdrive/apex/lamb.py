"""apex's LAMB optimizers in torch: ``FusedLAMB`` (:class:`Lamb`) and ``FusedMixedPrecisionLamb``
(:class:`MixedPrecisionLamb`), one update rule (:func:`lamb_update`) under both.

apex's kernels: clip every gradient by the global norm (``g / (norm / max_grad_norm)`` when the norm exceeds
it), Adam moments, ``u = m_hat / (sqrt(v_hat) + eps) + wd * w`` (``adam_w_mode``; else the decay joins ``g``
first), then ``w -= lr * r * u`` with the trust ratio ``r = ||w|| / ||u||`` where both are nonzero and the group
has weight decay (or ``use_nvlamb``), else 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch

from overdrive._utils.errors import UsageError


def _check(name: str, lr: float, betas: tuple[float, float], eps: float, amsgrad: bool) -> None:
    if amsgrad:
        raise UsageError(f"{name}(amsgrad=True) is not supported: apex's {name} refused it too")
    if not float(lr) >= 0 or not eps >= 0 or not all(0 <= b < 1 for b in betas):
        raise UsageError(f"{name}(lr={float(lr)}, betas={betas}, eps={eps}): lr and eps >= 0, betas in [0, 1)")


def clip_divisor(grads: list[torch.Tensor], max_norm: float, scale: Any = 1.0) -> torch.Tensor | None:
    """What apex divides every gradient by: ``norm / max_norm`` when the global norm of ``grads / scale``
    exceeds ``max_norm`` (else 1), as a device tensor (no host sync); None when ``max_norm <= 0``."""
    if max_norm <= 0 or not grads:
        return None
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) / scale
    return torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm))


def _saved_state_by_param(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """Each parameter of ``optimizer`` with the state ``state_dict`` saved for it, before torch's
    ``load_state_dict`` casts that state to the parameter's dtype (the saved ids map to the parameters in group
    order, as torch maps them)."""
    saved_ids = chain.from_iterable(g["params"] for g in state_dict.get("param_groups", []))
    mine = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    state = state_dict.get("state", {})
    return {p: state.get(i, {}) for i, p in zip(saved_ids, mine)}


def lamb_update(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: Any, group: dict[str, Any],
                adam_w_mode: bool, use_nvlamb: bool) -> torch.Tensor:
    """One LAMB step of one tensor: the new fp32 weight. ``w`` and ``g`` are fp32 (``g`` unscaled and clipped);
    the moments ``m`` and ``v`` are updated in place; ``t`` is the step number (an int or a tensor).

    Example:
        >>> w, g = torch.ones(3), torch.ones(3); m, v = torch.zeros(3), torch.zeros(3)
        >>> group = {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0,
        ...          "grad_averaging": True, "bias_correction": True}
        >>> lamb_update(w, g, m, v, 1, group, adam_w_mode=True, use_nvlamb=False)
        tensor([0.9000, 0.9000, 0.9000])
    """
    b1, b2 = group["betas"]
    wd = group["weight_decay"]
    if not adam_w_mode and wd:
        g = g + wd * w
    m.mul_(b1).add_(g, alpha=(1 - b1) if group["grad_averaging"] else 1.0)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    c1 = 1 - b1**t if group["bias_correction"] else 1.0
    c2 = 1 - b2**t if group["bias_correction"] else 1.0
    update = (m / c1) / ((v / c2).sqrt() + group["eps"])
    if adam_w_mode and wd:
        update = update + wd * w
    lr = group["lr"]
    if use_nvlamb or wd:
        w_norm, u_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(update)
        lr = torch.where((w_norm > 0) & (u_norm > 0), lr * w_norm / u_norm, lr * torch.ones_like(w_norm))
    return w - lr * update


class Lamb(torch.optim.Optimizer):
    """apex.optimizers.FusedLAMB in torch (see the module docstring); moments in fp32.

    The layout is apex's, so its checkpoints load: one ``step`` per param group (advanced at every ``step()``,
    the bias correction of a parameter that had no gradient for a while follows its group's count), the moments
    ``exp_avg`` / ``exp_avg_sq`` per parameter. Gradients are clipped by the constructor's ``max_grad_norm``
    over all groups together.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4)); opt = Lamb([w], lr=0.1)
        >>> w.grad = torch.ones(4); opt.step(); round(float(w.detach()[0]), 4)
        0.9
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False) -> None:
        _check("FusedLAMB", lr, betas, eps, amsgrad)
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": grad_averaging, "max_grad_norm": max_grad_norm}
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, keeping the moments fp32: torch casts the state to each parameter's dtype, which would round
        a half model's fp32 moments at every resume (the resumed run drifting from the uninterrupted one); the
        half moments of apex's checkpoints are widened to fp32.

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)); opt = Lamb([w])
            >>> w.grad = torch.ones(2, dtype=torch.bfloat16); opt.step()
            >>> opt.load_state_dict(opt.state_dict()); opt.state[w]["exp_avg"].dtype
            torch.float32
        """
        saved = _saved_state_by_param(self, state_dict)
        super().load_state_dict(state_dict)
        for q, st in saved.items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = st.get(key)
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[q][key] = value.detach().to(q.device, torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [q.grad for g in self.param_groups for q in g["params"] if q.grad is not None]
        # one global norm over every gradient, clipped by the constructor's max_grad_norm (apex's defaults value)
        clip = clip_divisor(grads, self.defaults["max_grad_norm"])
        for group in self.param_groups:
            if "step" not in group:
                # a fresh group; or a checkpoint of this class's older layout, one step per parameter state
                old = [self.state[q].pop("step") for q in group["params"] if "step" in self.state.get(q, {})]
                group["step"] = int(max(old, default=0))
            group["step"] += 1  # as apex: one step per group, advanced at every step() call
            for q in group["params"]:
                if q.grad is None:
                    continue
                state = self.state[q]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(q, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(q, dtype=torch.float32)
                g = q.grad.float() if clip is None else q.grad.float() / clip.to(q.device)
                new = lamb_update(q.float(), g, state["exp_avg"], state["exp_avg_sq"], group["step"], group,
                                  self.adam_w_mode, self.use_nvlamb)
                q.copy_(new)
        return loss


class MixedPrecisionLamb(torch.optim.Optimizer):
    """apex.optimizers.FusedMixedPrecisionLamb: LAMB whose moments, and the fp32 master of every parameter of
    ``reduced_precision_dtype``, are kept in fp32; the half parameter is the master rounded after each step.

    As in apex: each group's ``lr`` and ``step`` are tensors on the parameters' device; ``max_grad_norm`` is the
    constructor's, for the global norm over all groups; with torch's ``GradScaler`` (``scaler.step(opt)``) the
    gradients are unscaled here and a step with inf/NaN gradients is skipped whole, ``step`` not advanced. The
    masters live in each parameter's state (``master_param``), so a checkpoint carries them (apex made them
    again from the half weights); a state dict without them (apex's) makes them from the weights at the next step.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = MixedPrecisionLamb([w], lr=1e-3, weight_decay=0.0, reduced_precision_dtype=torch.bfloat16)
        >>> w.grad = torch.ones(4, dtype=torch.bfloat16); opt.step()
        >>> opt.state[w]["master_param"].dtype, float(opt.state[w]["master_param"][0])  # 1 - 1e-3, kept
        (torch.float32, 0.9990000128746033)
    """

    _tensor_keys = ("lr", "step")

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, step: int = 0, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 reduced_precision_dtype: torch.dtype | None = None) -> None:
        _check("FusedMixedPrecisionLamb", lr, betas, eps, amsgrad)
        defaults = {"lr": torch.tensor(float(lr), dtype=torch.float32),
                    "step": torch.tensor([step], dtype=torch.int32), "bias_correction": bias_correction,
                    "betas": betas, "eps": eps, "weight_decay": weight_decay, "grad_averaging": grad_averaging,
                    "max_grad_norm": max_grad_norm}
        super().__init__(params, defaults)
        self.reduced_precision_dtype = reduced_precision_dtype
        self.adam_w_mode = adam_w_mode
        self.use_nvlamb = use_nvlamb
        # torch's GradScaler then hands over grad_scale / found_inf instead of unscaling and checking itself
        self._step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then ``lr`` / ``step`` as tensors of the group's own on its device (torch would share the
        defaults' tensors between groups, and ``step`` is advanced in place)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        for key in self._tensor_keys:
            dtype = torch.float32 if key == "lr" else torch.int32
            group[key] = torch.as_tensor(group[key], dtype=dtype).to(device).clone().reshape(-1 if key == "step"
                                                                                               else ())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, keeping the fp32 moments and masters fp32 (torch casts state to each parameter's dtype) and
        the groups' ``lr`` / ``step`` tensors on the parameters' device."""
        by_param = _saved_state_by_param(self, state_dict)
        super().load_state_dict(state_dict)
        for p, saved in by_param.items():
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and p.dtype != torch.float32:
                    self.state[p][key] = value.to(p.device, copy=True)
        for group in self.param_groups:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            for key in self._tensor_keys:
                if isinstance(group[key], torch.Tensor):
                    group[key] = group[key].to(device)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # set by torch's GradScaler.step for optimizers with _step_supports_amp_scaling
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # one host sync, as GradScaler's own skip check
            return loss
        scale = 1.0 if grad_scale is None else grad_scale.float()
        grads = [q.grad for g in self.param_groups for q in g["params"] if q.grad is not None]
        clip = clip_divisor(grads, self.defaults["max_grad_norm"], scale)
        for group in self.param_groups:
            params = [q for q in group["params"] if q.grad is not None]
            if not params:
                continue
            step = group["step"]
            if isinstance(step, torch.Tensor):
                step += 1
            else:
                group["step"] = step = step + 1
            t = step.reshape(()).to(torch.float32) if isinstance(step, torch.Tensor) else step
            lr = torch.as_tensor(group["lr"], dtype=torch.float32)
            for q in params:
                state = self.state[q]
                reduced = self.reduced_precision_dtype is not None and q.dtype == self.reduced_precision_dtype
                if "exp_avg" not in state:
                    dtype = torch.float32 if reduced else q.dtype
                    state["exp_avg"] = torch.zeros_like(q, dtype=dtype)
                    state["exp_avg_sq"] = torch.zeros_like(q, dtype=dtype)
                if reduced and "master_param" not in state:
                    state["master_param"] = q.detach().float().clone()
                master = state["master_param"] if reduced else q
                g = q.grad.float() / scale
                if clip is not None:
                    g = g / clip.to(q.device)
                # fp32 math; moments kept in another dtype (a half parameter without reduced_precision_dtype,
                # as apex) are updated in fp32 copies and written back
                m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
                new = lamb_update(master.float(), g, m, v, t.to(q.device) if isinstance(t, torch.Tensor) else t,
                                  dict(group, lr=lr.to(q.device)), self.adam_w_mode, self.use_nvlamb)
                for key, value in (("exp_avg", m), ("exp_avg_sq", v)):
                    if state[key] is not value:
                        state[key].copy_(value)
                master.copy_(new)
                if reduced:
                    q.copy_(master)
        return loss


__all__ = ["Lamb", "MixedPrecisionLamb", "clip_divisor", "lamb_update"]
