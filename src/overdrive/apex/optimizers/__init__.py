"""apex.optimizers over torch.optim, with apex's arguments, under apex's import paths (``from apex.optimizers import
FusedAdam`` and ``from apex.optimizers.fused_adam import FusedAdam``, and so on for each optimizer).

``FusedAdam`` is torch's Adam with AdamW's decoupled decay (apex's default ``adam_w_mode=True``) or L2 decay,
``FusedSGD`` torch's SGD, each with ``fused=True`` when every parameter is on a device torch has a fused kernel for,
else ``foreach=True``;
``FusedAdagrad`` is torch's Adagrad with apex's decoupled ``adagrad_w_mode``. torch has no LAMB or NovoGrad, so
``FusedLAMB`` / ``FusedMixedPrecisionLamb`` (:mod:`overdrive.apex.lamb`) and ``FusedNovoGrad``
(:mod:`overdrive.apex.novograd`) are apex's algorithms written in torch, checked against float64 references.
Arguments apex had and torch lacks are refused with what to do instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import required

from overdrive._utils.errors import UsageError
from overdrive.apex.fp16_utils import FP16_Optimizer as _FP16_Optimizer
from overdrive.apex.lamb import Lamb, MixedPrecisionLamb
from overdrive.apex.novograd import NovoGrad

_FUSED_DEVICES = ("cuda", "cpu", "mps", "xpu")


def _materialize(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list, each param group's ``"params"`` too: a group given a generator
    (``{"params": model.head.parameters()}``) is read once here, and would reach torch empty."""
    out = []
    for g in params:
        if isinstance(g, dict):
            g = dict(g)
            ps = g.get("params")
            g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps) if ps is not None else []
        out.append(g)
    return out


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


def _with_param_steps(name: str, state_dict: dict[str, Any], missing: float | None = None) -> dict[str, Any]:
    """``state_dict`` in torch's layout: apex's FusedAdam and FusedAdagrad kept one ``step`` per param group and
    none per parameter, and torch's ``load_state_dict`` failed on such a checkpoint with ``KeyError: 'step'``.
    Each parameter's state without a step gets its group's (``missing`` where the group has none, else an error);
    the groups lose theirs (it would go stale)."""
    state = state_dict.get("state", {})
    if not any(isinstance(s, dict) and s and "step" not in s for s in state.values()):
        return state_dict
    state, groups = dict(state), []
    for group in state_dict.get("param_groups", []):
        group = dict(group)
        step = group.pop("step", missing)
        for pid in group.get("params", []):
            saved = state.get(pid)
            if saved and "step" not in saved:
                if step is None:
                    raise UsageError(f"{name}.load_state_dict: parameter {pid}'s state has no 'step' and its param "
                                     "group none either (apex's layout keeps it in the group); pass a state dict "
                                     f"saved by {name}, torch's optimizer or apex's")
                state[pid] = dict(saved, step=torch.tensor(float(step), dtype=torch.float32))
        groups.append(group)
    return dict(state_dict, state=state, param_groups=groups)


class FusedAdam(torch.optim.Adam):
    """apex.optimizers.FusedAdam: torch's Adam with decoupled weight decay (``adam_w_mode=True``, apex's default: AdamW's
    math) or L2 weight decay (``adam_w_mode=False``), ``fused=True`` where torch has a fused kernel, else foreach.

    A class, as apex's was: ``isinstance(opt, FusedAdam)`` (Megatron's check) and subclasses (fairseq's
    ``FusedAdamV2(FusedAdam)``) work, and ``isinstance(opt, torch.optim.Adam)`` holds. ``bias_correction=False``
    (DeepLearningExamples' BERT fine-tuning) steps ``w -= lr * m / (sqrt(v) + eps)`` with the moments uncorrected;
    the state keeps torch's layout (``step``, ``exp_avg``, ``exp_avg_sq``) either way, so checkpoints move between
    the two and torch's Adam.

    Example:
        >>> opt = FusedAdam(torch.nn.Linear(4, 2).parameters(), lr=1e-3, weight_decay=0.01)
        >>> isinstance(opt, torch.optim.Adam), opt.defaults["decoupled_weight_decay"], opt.defaults["fused"]
        (True, True, True)
    """

    def __init__(
        self,
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
    ) -> None:
        _refuse("FusedAdam", master_weights=(master_weights, master_weights,
                                             "use amp.initialize(..., opt_level='O2') for fp32 master weights"))
        params = _materialize(params)
        # set_grad_none: torch's zero_grad sets grads to None by default already
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         capturable=capturable, decoupled_weight_decay=bool(adam_w_mode), **_fast_path(params))
        self.defaults["bias_correction"] = bool(bias_correction)
        for group in self.param_groups:
            group.setdefault("bias_correction", bool(bias_correction))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, also taking apex's FusedAdam checkpoints (the step count kept per param group).

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2)); opt = FusedAdam([w])
            >>> apex_sd = {"state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}},
            ...            "param_groups": [dict(opt.state_dict()["param_groups"][0], step=7)]}
            >>> opt.load_state_dict(apex_sd); int(opt.state[w]["step"])
            7
        """
        super().load_state_dict(_with_param_steps("FusedAdam", state_dict))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """torch's Adam step for groups with ``bias_correction`` (all, by default); the uncorrected update for the
        others. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        raw = [g for g in groups if not g.get("bias_correction", True)]
        corrected = [g for g in groups if g.get("bias_correction", True)]
        if corrected:
            # torch wraps each optimizer class's step with the step hooks; this class's step ran them already
            step = torch.optim.Adam.step
            self.param_groups = corrected
            try:
                getattr(step, "__wrapped__", step)(self)
            finally:
                self.param_groups = groups
        for group in raw:
            self._uncorrected_step(group)
        return loss

    def _uncorrected_step(self, group: dict[str, Any]) -> None:
        """Adam without bias correction, in torch's state layout; honours a GradScaler's ``grad_scale`` /
        ``found_inf`` as torch's fused step does."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.reshape(-1).any()):
            return
        grad_scale = getattr(self, "grad_scale", None)
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        on_device = group.get("fused") or group.get("capturable")
        buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
        for q in group["params"]:
            if q.grad is None:
                continue
            st = self.state[q]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=q.device if on_device else "cpu")
                st["exp_avg"] = torch.zeros_like(q, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(q, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    st["max_exp_avg_sq"] = torch.zeros_like(q, memory_format=torch.preserve_format)
            st["step"] += 1
            grad = q.grad if grad_scale is None else q.grad / grad_scale.to(q.grad.device)
            if group["maximize"]:
                grad = -grad
            lists = buckets.setdefault((q.device, q.dtype), [[], [], [], [], []])
            for dst, t in zip(lists, (q, grad, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq", st["exp_avg_sq"]))):
                dst.append(t)
        for (_, dtype), (qs_out, grads, m1_out, m2_out, mx_out) in buckets.items():
            # the math in fp32 for half parameters, as apex's kernel: in fp16, eps=1e-8 is 0 and a zero
            # gradient's update is 0/0
            half = dtype in (torch.float16, torch.bfloat16)
            qs, m1, m2 = ([t.float() for t in ts] if half else ts for ts in (qs_out, m1_out, m2_out))
            mx = [t.float() for t in mx_out] if half and group["amsgrad"] else mx_out
            if half:
                grads = [g.float() for g in grads]
            if wd:
                if group["decoupled_weight_decay"]:
                    torch._foreach_mul_(qs, 1 - lr * wd)
                else:
                    grads = torch._foreach_add(grads, qs, alpha=wd)
            torch._foreach_lerp_(m1, grads, 1 - beta1)
            torch._foreach_mul_(m2, beta2)
            torch._foreach_addcmul_(m2, grads, grads, value=1 - beta2)
            if group["amsgrad"]:
                torch._foreach_maximum_(mx, m2)
                denom = torch._foreach_sqrt(mx)
            else:
                denom = torch._foreach_sqrt(m2)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(qs, m1, denom, value=-lr)
            if half:  # written back in the parameters' dtype
                outs = (qs_out, m1_out, m2_out) + ((mx_out,) if group["amsgrad"] else ())
                for out, new in zip(outs, (qs, m1, m2, mx)):
                    torch._foreach_copy_(out, new)


class FusedSGD(torch.optim.SGD):
    """apex.optimizers.FusedSGD: ``torch.optim.SGD`` (fused where torch has the kernel, else foreach), a class as
    apex's was (``isinstance(opt, FusedSGD)`` and ``isinstance(opt, torch.optim.SGD)`` hold).

    Example:
        >>> opt = FusedSGD(torch.nn.Linear(4, 2).parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> isinstance(opt, torch.optim.SGD), opt.defaults["nesterov"]
        (True, True)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
    ) -> None:
        _refuse("FusedSGD", wd_after_momentum=(wd_after_momentum, wd_after_momentum,
                                               "torch's SGD adds weight decay before momentum"))
        params = _materialize(params)
        if lr is required:
            # apex's lr had no default: every param group must name its own, else the run would train at a lr
            # nobody chose
            groups = [g for g in params if isinstance(g, dict)]
            if len(groups) != len(params) or not params or any("lr" not in g for g in groups):
                raise UsageError("FusedSGD needs a learning rate (apex's lr has no default): pass lr=..., e.g. "
                                 "FusedSGD(model.parameters(), lr=0.1), or an 'lr' in every param group")
            first_lr = groups[0]["lr"]
        super().__init__(params, lr=first_lr if lr is required else lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, **_fast_path(params))
        if lr is required:
            self.defaults["lr"] = required  # a group added later must name its lr too, as in apex


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
        params = _materialize(params)
        # torch has a fused Adagrad for CPU tensors only
        tensors = [q for g in params for q in (g["params"] if isinstance(g, dict) else [g])]
        fast = {"fused": True} if tensors and all(q.device.type == "cpu" for q in tensors) else {"foreach": True}
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, **fast)
        self.state.clear()  # torch's constructor made it; see _init_state
        self.adagrad_w_mode = adagrad_w_mode

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, also taking apex's FusedAdagrad checkpoints (``sum`` per parameter and no step count anywhere:
        Adagrad without lr decay never reads it, so it starts at 0)."""
        super().load_state_dict(_with_param_steps("FusedAdagrad", state_dict, missing=0.0))

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
        """torch's Adagrad step for the fp32/fp64 parameters; the fp16/bf16 ones step in fp32 math, as apex's kernel
        did (torch's kernels work in the half dtype, where eps=1e-10 is 0: a zero gradient on a zero sum, an unused
        embedding row, becomes 0/0 = NaN)."""
        half = {q: q.grad for g in self.param_groups for q in g["params"]
                if q.grad is not None and q.dtype in (torch.float16, torch.bfloat16)}
        for q in half:
            q.grad = None  # torch's step skips parameters without a gradient
        try:
            # torch wraps the step of each optimizer class it builds with the step hooks; once a plain Adagrad
            # exists its step is wrapped too, and calling it through super() would run this optimizer's hooks a
            # second time
            step = torch.optim.Adagrad.step
            getattr(step, "__wrapped__", step)(self)
        finally:
            for q, grad in half.items():
                q.grad = grad
        if half:
            self._half_step(half)

    def _half_step(self, half: dict[torch.Tensor, torch.Tensor]) -> None:
        """torch's Adagrad update (L2 ``weight_decay``, ``lr_decay``) of the half parameters in ``half`` in fp32,
        state kept in their dtype; honours a GradScaler's ``grad_scale`` / ``found_inf`` as torch's fused step does."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.reshape(-1).any()):
            return
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            for q in (q for q in group["params"] if q in half):
                st = self.state[q]
                st["step"] += 1
                g = half[q].float()
                if grad_scale is not None:
                    g = g / grad_scale.to(g.device)
                if group["maximize"]:
                    g = -g
                w = q.float()
                if group["weight_decay"]:
                    g = g + group["weight_decay"] * w
                clr = group["lr"] / (1 + (float(st["step"]) - 1) * group["lr_decay"])
                total = st["sum"].float().addcmul_(g, g)
                w.addcdiv_(g, total.sqrt().add_(group["eps"]), value=-clr)
                st["sum"].copy_(total)
                q.copy_(w)

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
FP16_Optimizer = _FP16_Optimizer  # noqa: N816 - apex.optimizers exported it before it moved to apex.fp16_utils

__all__ = ["FP16_Optimizer", "FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad",
           "FusedSGD", "Lamb", "MixedPrecisionLamb", "NovoGrad"]
