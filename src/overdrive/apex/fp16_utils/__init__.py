"""apex.fp16_utils: ``FP16_Optimizer`` (fp32 master weights and loss scaling around any torch optimizer),
``network_to_half``, ``BN_convert_float``, ``tofp16``, ``FP16_Module``, ``prep_param_lists``,
``model_grads_to_master_grads``, ``master_params_to_model_params`` and ``to_python_float``.

The loss scaling is :class:`overdrive.amp.LossScaler` and the overflow check overdrive.amp's fused one (one host
sync per backward). "Half" is the half dtype overdrive.amp uses on the device: float16 on CUDA, bfloat16 on the
CPU (where amp refuses fp16). ``network_to_half`` and ``tofp16`` cast to it unless given ``dtype``;
``FP16_Optimizer`` takes a model in either half dtype (``model.half()`` works on the CPU too, slowly). New code:
``amp.initialize(model, optimizer, opt_level="O2")`` keeps the same fp32 masters without the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from overdrive._utils.errors import UsageError
from overdrive.amp.casting import saturating_cast
from overdrive.amp.guard import StepGuard, found_nonfinite, read_flags
from overdrive.amp.scaler import LossScaler
from overdrive.apex.apex_C import flatten, unflatten

HALF = (torch.float16, torch.bfloat16)


def to_python_float(t: Any) -> float:
    """A one-element tensor (or a number) as a Python float: ``t.item()``, as apex did.

    Example:
        >>> to_python_float(torch.tensor(0.5))
        0.5
    """
    if hasattr(t, "item"):
        return t.item()
    return t[0] if isinstance(t, (list, tuple)) else float(t)


def half_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The half dtype overdrive.amp uses on ``device``: float16 on CUDA, bfloat16 elsewhere.

    Example:
        >>> half_dtype("cpu")
        torch.bfloat16
    """
    return torch.float16 if torch.device(device or "cpu").type == "cuda" else torch.bfloat16


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class tofp16(nn.Module):  # noqa: N801 - apex's name
    """A module whose forward casts its input to half: ``dtype``, or the input device's half dtype (apex:
    ``input.half()``).

    Example:
        >>> tofp16()(torch.ones(2)).dtype
        torch.bfloat16
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - apex's argument name
        return input.to(self.dtype or half_dtype(input.device))


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - apex's name
    """Cast every BatchNorm layer of ``module`` back to fp32, in place (their statistics need it); returns it.

    Example:
        >>> net = BN_convert_float(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).half())
        >>> net[0].weight.dtype, net[1].weight.dtype
        (torch.float16, torch.float32)
    """
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.float()
    return module


def network_to_half(network: nn.Module, dtype: torch.dtype | None = None) -> nn.Sequential:
    """apex's ``nn.Sequential(tofp16(), BN_convert_float(network.half()))``: the network in half (``dtype``, default
    the half dtype of its device) with fp32 BatchNorm, its inputs cast on the way in.

    Example:
        >>> net = network_to_half(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)))
        >>> net(torch.randn(3, 4)).dtype, net[1][1].weight.dtype
        (torch.bfloat16, torch.float32)
    """
    dtype = dtype or half_dtype(_device_of(network))
    return nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def _convert(val: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(val, (tuple, list)):
        out = [_convert(v, fn) for v in val]
        return tuple(out) if isinstance(val, tuple) else out
    return fn(val) if isinstance(val, torch.Tensor) else val


def fp32_to_fp16(val: Any, dtype: torch.dtype | None = None) -> Any:
    """fp32 tensors in ``val`` (nested lists/tuples too) cast to half (``dtype`` or the device's); others as they are.
    Finite values beyond the half range (an additive attention mask of float32's min) become its largest finite
    value, not inf.

    Example:
        >>> fp32_to_fp16([torch.tensor([-1e9])], torch.float16)[0].tolist()
        [-65504.0]
    """
    return _convert(val, lambda t: saturating_cast(t, dtype or half_dtype(t.device)) if t.dtype == torch.float32 else t)


def fp16_to_fp32(val: Any) -> Any:
    """Half (fp16 or bf16) tensors in ``val`` (nested lists/tuples too) cast to fp32; others as they are."""
    return _convert(val, lambda t: t.float() if t.dtype in HALF else t)


class FP16_Module(nn.Module):  # noqa: N801 - apex's name
    """apex's wrapper: ``module`` in half (``dtype`` or its device's), fp32 inputs cast in, half outputs cast out.

    Example:
        >>> FP16_Module(nn.Linear(4, 2))(torch.randn(3, 4)).dtype
        torch.float32
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype or half_dtype(_device_of(module))
        self.add_module("module", module.to(self.dtype))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return fp16_to_fp32(self.module(*fp32_to_fp16(inputs, self.dtype), **kwargs))


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(model_params, master_params)``: the model's trainable parameters and fp32 copies of them (one flat fp32
    Parameter, with a gradient buffer, when ``flat_master``).

    Example:
        >>> model_params, master_params = prep_param_lists(nn.Linear(4, 2).half())
        >>> master_params[0].dtype, master_params[0].requires_grad
        (torch.float32, True)
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if len({p.dtype for p in model_params}) > 1:
            raise UsageError("prep_param_lists(flat_master=True) needs parameters of one dtype; this model mixes "
                             f"{sorted({str(p.dtype) for p in model_params})}: use flat_master=False or FP16_Optimizer")
        master = nn.Parameter(flatten([p.detach() for p in model_params]).float())
        master.grad = torch.empty_like(master)
        return model_params, [master]
    return model_params, [nn.Parameter(p.detach().clone().float()) for p in model_params]


def model_grads_to_master_grads(model_params: Sequence[nn.Parameter], master_params: Sequence[nn.Parameter],
                                flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' (fp32); a model parameter without one leaves its master None."""
    if flat_master:
        master_params[0].grad.copy_(flatten([p.grad for p in model_params]))  # type: ignore[union-attr]
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
        elif master.grad is None:
            master.grad = model.grad.detach().float()
        else:
            master.grad.copy_(model.grad)


@torch.no_grad()
def master_params_to_model_params(model_params: Sequence[nn.Parameter], master_params: Sequence[nn.Parameter],
                                  flat_master: bool = False) -> None:
    """Copy the masters' values into the model's parameters (rounded to their dtype)."""
    if flat_master:
        masters = unflatten(master_params[0].detach(), list(model_params))
    else:
        masters = [m.detach() for m in master_params]
    if model_params:
        torch._foreach_copy_(list(model_params), masters)


_DYNAMIC_ARGS = {"init_scale", "scale_factor", "scale_window", "min_scale", "max_scale"}


class FP16_Optimizer:  # noqa: N801 - apex's name
    """apex's FP16_Optimizer: wraps ``init_optimizer`` (built on a half model's parameters) so that it steps fp32
    master copies, with a static or dynamic loss scale; replace ``loss.backward()`` by ``optimizer.backward(loss)``.

    The half parameters (fp16 or bf16) of each param group are replaced by fp32 masters in ``init_optimizer``
    itself (apex built a new optimizer of the same class); fp32 parameters are stepped as they are. ``step()``
    copies the masters back into the model. ``dynamic_loss_args`` are apex's ``init_scale`` (2**32),
    ``scale_factor`` (2) and ``scale_window`` (1000), and ``min_scale`` (1) / ``max_scale`` (none).

    Unlike apex, a step whose gradients hold inf/NaN is skipped with a static scale too (with a warning; apex
    applied it), and ``backward`` called twice before a step accumulates fp32 parameters' gradients exactly.

    Example:
        >>> model = nn.Linear(4, 2).to(torch.bfloat16)
        >>> optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
        >>> optimizer.backward(model(torch.ones(3, 4, dtype=torch.bfloat16)).float().sum())
        >>> optimizer.step(); optimizer.zero_grad()
        >>> optimizer.loss_scale, optimizer.fp32_from_fp16_groups[0][0].dtype
        (4294967296.0, torch.float32)
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 verbose: bool = False) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise UsageError(f"FP16_Optimizer wraps a torch.optim.Optimizer; got {type(init_optimizer).__name__}")
        if isinstance(dynamic_loss_args, dict) and not dynamic_loss_scale:
            raise UsageError("dynamic_loss_args given with dynamic_loss_scale=False; pass dynamic_loss_scale=True")
        self.fp16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_fp16_groups: list[list[nn.Parameter]] = []
        self.fp32_from_fp32_groups: list[list[nn.Parameter]] = []
        for group in init_optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            for p in params:
                if p.dtype not in HALF + (torch.float32,):
                    raise UsageError(f"FP16_Optimizer takes fp16, bf16 or fp32 parameters; got {p.dtype}")
            half = [p for p in params if p.dtype in HALF]
            masters = [nn.Parameter(p.detach().clone().float()) for p in half]
            fp32 = [p for p in params if p.dtype == torch.float32]
            group["params"] = masters + fp32
            self.fp16_groups.append(half)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32)
        # the optimizer may have built per-parameter state or fused flags already: none of it refers to masters yet
        init_optimizer.state.clear()
        self.optimizer = init_optimizer
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        if self.dynamic_loss_scale:
            args = dict(dynamic_loss_args or {})
            unknown = set(args) - _DYNAMIC_ARGS
            if unknown:
                raise UsageError(f"dynamic_loss_args has {sorted(unknown)}; expected some of {sorted(_DYNAMIC_ARGS)}")
            factor = float(args.get("scale_factor", 2.0))
            self.loss_scaler = LossScaler(
                dynamic=True, init_scale=float(args.get("init_scale", 2.0**32)), growth_factor=factor,
                backoff_factor=1.0 / factor, growth_interval=int(args.get("scale_window", 1000)),
                min_scale=float(args.get("min_scale", 1.0)), max_scale=float(args.get("max_scale", float("inf"))))
        else:
            self.loss_scaler = LossScaler(dynamic=False, init_scale=float(static_loss_scale))
        self.guard = StepGuard("skip", None)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.verbose = verbose

    def __getstate__(self) -> dict[str, Any]:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    # --- apex's attributes ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.scale = float(value)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/NaN gradients so far (not in apex)."""
        return self.guard.skipped

    def _all(self, groups: list[list[nn.Parameter]]) -> list[nn.Parameter]:
        return [p for g in groups for p in g]

    # --- the training step ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' and the model's half gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p in self._all(self.fp16_groups):
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``; then, unless ``update_master_grads=False``, the masters get
        the unscaled gradients (:meth:`update_master_grads`)."""
        fp32 = self._all(self.fp32_from_fp32_groups)
        stash = [p.grad for p in fp32]  # unscaled already: set aside so only the new gradients get unscaled
        for p in fp32:
            p.grad = None
        try:
            (loss.float() * self.loss_scale).backward(retain_graph=retain_graph)
        finally:
            new = [p.grad for p in fp32 if p.grad is not None]
            if new and self.loss_scale != 1.0:
                torch._foreach_mul_(new, 1.0 / self.loss_scale)
            for p, s in zip(fp32, stash):
                if s is not None:
                    p.grad = s if p.grad is None else p.grad + s
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Check the gradients for inf/NaN (``self.overflow``), then copy the half gradients into the masters,
        unscaled (apex's name; ``backward`` calls it)."""
        half = [p.grad for p in self._all(self.fp16_groups) if p.grad is not None]
        fp32 = [p.grad for p in self._all(self.fp32_from_fp32_groups) if p.grad is not None]
        self.overflow = read_flags(found_nonfinite(half + fp32))[0]
        if self.overflow:
            return
        model_grads_to_master_grads(self._all(self.fp16_groups), self._all(self.fp32_from_fp16_groups))
        masters = [p.grad for p in self._all(self.fp32_from_fp16_groups) if p.grad is not None]
        if masters and self.loss_scale != 1.0:
            torch._foreach_mul_(masters, 1.0 / self.loss_scale)

    def _master_params_to_model_params(self) -> None:
        master_params_to_model_params(self._all(self.fp16_groups), self._all(self.fp32_from_fp16_groups))

    def _model_grads_to_master_grads(self) -> None:
        model_grads_to_master_grads(self._all(self.fp16_groups), self._all(self.fp32_from_fp16_groups))

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor | int:
        """Clip the fp32 master gradients (``torch.nn.utils.clip_grad_norm_``) and return their norm; -1 when the
        last backward overflowed, as apex."""
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the scale, then step the masters and copy them into the model; skip (return None) when the
        gradients overflowed. A ``closure`` must call this object's ``backward`` (static scale only, as apex)."""
        if closure is not None and self.dynamic_loss_scale:
            raise TypeError("Using step with a closure is currently not compatible with dynamic loss scaling.")
        self.loss_scaler.update(self.overflow)
        if self.overflow:
            why = None if self.dynamic_loss_scale else f"the gradients hold inf or NaN (static loss scale {self.loss_scale:g})"
            self.guard.step_skipped(0, why)
            if self.verbose:
                print(f"OVERFLOW! Skipping step, loss scale now {self.loss_scale:g}")
            for p in (q for g in self.optimizer.param_groups for q in g["params"]):
                p.grad = None
            self.overflow = False
            return None
        self.guard.step_taken(0)
        retval = self._step_with_closure(closure) if closure is not None else self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:  # the optimizer moved the masters between evaluations (LBFGS): the model must follow
                self._master_params_to_model_params()
            return closure()

        try:
            return self.optimizer.step(wrapped)
        finally:
            self.first_closure_call_this_step = True

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """The masters' gradients, one list per param group (None after an overflow)."""
        if self.overflow:
            return None
        return [[p.grad for p in g["params"]] for g in self.optimizer.param_groups]

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """apex's keys: ``loss_scaler`` (here the scaler's state, a dict), ``dynamic_loss_scale``, ``overflow``,
        ``first_closure_call_this_step``, ``optimizer_state_dict`` and ``fp32_from_fp16`` (the masters)."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[p.detach().clone() for p in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (after ``model.load_state_dict``): the scale, the wrapped optimizer's
        state and the fp32 masters, copied into the model too."""
        if bool(state_dict["dynamic_loss_scale"]) != self.dynamic_loss_scale:
            raise UsageError(f"the checkpoint's dynamic_loss_scale={state_dict['dynamic_loss_scale']} differs from this "
                             f"FP16_Optimizer's {self.dynamic_loss_scale}; build it the same way to resume")
        saved = state_dict["loss_scaler"]
        if isinstance(saved, dict):
            self.loss_scaler.load_state_dict(saved)
        else:  # an apex LossScaler object (a checkpoint apex pickled): its scale
            self.loss_scaler.scale = float(saved.cur_scale)
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        masters = state_dict["fp32_from_fp16"]
        if [len(g) for g in masters] != [len(g) for g in self.fp32_from_fp16_groups]:
            raise UsageError(f"the checkpoint has {[len(g) for g in masters]} master params per group, this optimizer "
                             f"{[len(g) for g in self.fp32_from_fp16_groups]}; load one saved from the same model")
        with torch.no_grad():
            for current, saved_group in zip(self.fp32_from_fp16_groups, masters):
                for p, s in zip(current, saved_group):
                    p.copy_(s)
        self._master_params_to_model_params()


__all__ = [
    "FP16_Optimizer", "FP16_Module", "network_to_half", "BN_convert_float", "tofp16", "prep_param_lists",
    "model_grads_to_master_grads", "master_params_to_model_params", "fp32_to_fp16", "fp16_to_fp32",
    "to_python_float", "half_dtype",
]
